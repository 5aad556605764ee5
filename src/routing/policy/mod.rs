//! How a peer is chosen, and what a choice gave: one file per policy, each over the same
//! [`view::View`] of the cluster and taking its slots the same way, so that they can be
//! compared on equal terms.
//!
//! - `round_robin`: weighted rotation under `max_in_flight`.
//! - `least_in_flight`: the fewest requests per unit of weight.
//! - `consistent_hash`: the key's peer, however loaded.
//! - `bounded`: clockwise from the key's point, the first peer under its bound
//!   ([`balance`]: `ceil(c · (in_flight + 1) · w_p / Σw)`, weighted consistent hashing with
//!   bounded loads).
//! - `least_cost`, the default: prices the first few peers of that walk, and the peers that
//!   hold part of the prompt, by the seed's cost rule ([`crate::routing::cost`]) and takes the
//!   cheapest under the same bound, floored at what the engine runs at once.
//!
//! The types live in `balance` (what is asked of a policy, and the bound) and `decision` (what
//! a request asks, what it got), re-exported here; this file only dispatches.

pub mod balance;
mod bounded;
mod consistent_hash;
pub mod decision;
mod least_cost;
mod least_in_flight;
mod round_robin;
pub mod view;

pub use balance::{Balance, BoundInputs, Policy, DEFAULT_BALANCE_FACTOR};
pub use decision::{Decision, Demand, Route, Routed};

use view::View;

/// Chooses a peer of `view` for `demand` under `balance` (without a key: spread by load), and
/// takes its slot.
pub fn select(balance: &Balance, view: &View, demand: &Demand) -> Decision {
    match (balance.policy, demand.hash) {
        (Policy::ConsistentHash, Some(h)) => consistent_hash::select(view, h),
        (Policy::BoundedConsistentHash, Some(h)) => bounded::select(view, balance, h),
        (Policy::LeastCost, Some(h)) => least_cost::select(view, balance, h, demand),
        (Policy::RoundRobin, _) => round_robin::select(view),
        (Policy::LeastInFlight, _) | (_, None) => least_in_flight::select(view),
    }
}

/// Chooses a peer for a request too light to be bounded: the consistent hash of its key, or
/// without one of a point of its own (then it is `Balanced`), whatever the peer's load.
pub fn unbounded(view: &View, hash: Option<u64>) -> Decision {
    // Without a key, from a point of its own: Fibonacci hashing spreads consecutive counts
    // over the ring.
    let point = hash.unwrap_or_else(|| {
        let count = view
            .cursor
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (count as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    });
    match consistent_hash::select(view, point) {
        Decision::Routed(routed) if hash.is_none() => Decision::Routed(Routed {
            route: Route::Balanced,
            ..routed
        }),
        decision => decision,
    }
}
