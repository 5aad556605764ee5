//! Pure sticky hashing: the first usable peer clockwise from the key's point, however loaded,
//! unless it is wedged: no bound stops a request there, but a request sent to an engine that
//! answers nothing is one the client waits on for the whole read timeout.

use super::decision::Decision;
use super::view::View;

pub fn select(view: &View, point: u64) -> Decision {
    view.walk_select(view.ring.walk(point), 0, |p| {
        (!p.wedged()).then(|| p.take())
    })
}
