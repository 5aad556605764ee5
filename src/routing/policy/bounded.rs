//! Consistent hashing with bounded loads: clockwise from the key's point over distinct peers,
//! the first usable one under its bound (see [`super::balance`]).

use super::balance::Balance;
use super::decision::Decision;
use super::view::View;

pub fn select(view: &View, balance: &Balance, point: u64) -> Decision {
    view.walk_select(view.ring.walk(point), 0, |p| {
        p.try_take(view.bound(balance, p))
    })
}
