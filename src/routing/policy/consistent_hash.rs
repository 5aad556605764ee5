//! Pure sticky hashing: the first usable peer clockwise from the key's point, however loaded.

use super::decision::Decision;
use super::view::View;

pub fn select(view: &View, point: u64) -> Decision {
    view.walk_select(view.ring.walk(point), 0, |p| Some(p.take()))
}
