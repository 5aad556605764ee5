//! Weighted rotation: each peer in turn, as many times per round as its weight, skipping the
//! peers at their `max_in_flight`.

use std::sync::atomic::Ordering;

use super::decision::{Decision, Route, Routed};
use super::view::View;

pub fn select(view: &View) -> Decision {
    let n = view.rotation.len();
    if n == 0 {
        return Decision::NoPeer;
    }
    let start = view.cursor.fetch_add(1, Ordering::Relaxed);
    let mut candidates = 0;
    for i in 0..n {
        let peer = &view.peers[view.rotation[(start + i) % n] as usize];
        if !view.usable(peer) {
            continue;
        }
        candidates += 1;
        if let Some(slot) = peer.try_take(peer.max_in_flight()) {
            return Decision::Routed(Routed {
                slot,
                route: Route::Balanced,
                steps: candidates,
            });
        }
    }
    if candidates == 0 {
        Decision::NoPeer
    } else {
        Decision::Saturated
    }
}
