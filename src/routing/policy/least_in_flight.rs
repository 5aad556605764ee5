//! The peer with the fewest requests per unit of weight, under its `max_in_flight`.

use std::sync::Arc;

use super::decision::{Decision, Route, Routed};
use super::view::View;
use crate::routing::peer::Peer;

pub fn select(view: &View) -> Decision {
    // A lost race for the least-loaded peer's last slot looks again; a few tries suffice,
    // since each lost race means another request made progress.
    for _ in 0..4 {
        let mut best: Option<&Arc<Peer>> = None;
        let mut any = false;
        for peer in view.peers.iter().filter(|p| view.usable(p)) {
            any = true;
            // A wedged peer takes nothing however light: chosen, it would refuse every try.
            if peer.wedged() || peer.load() >= peer.max_in_flight() {
                continue;
            }
            let lighter = best.is_none_or(|b| {
                u64::from(peer.load()) * u64::from(b.weight())
                    < u64::from(b.load()) * u64::from(peer.weight())
            });
            if lighter {
                best = Some(peer);
            }
        }
        let Some(peer) = best else {
            return if any {
                Decision::Saturated
            } else {
                Decision::NoPeer
            };
        };
        if let Some(slot) = peer.try_take(peer.max_in_flight()) {
            return Decision::Routed(Routed {
                slot,
                route: Route::Balanced,
                steps: 1,
            });
        }
    }
    Decision::Saturated
}
