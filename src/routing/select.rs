//! Choosing a peer and taking its slot in one step.
//!
//! `bounded_consistent_hash` walks clockwise from the key's point over distinct peers and takes
//! the first that is eligible and under its bound, the smaller of the peer's `max_in_flight`
//! and, when a balance factor `c` is set, `ceil(c · (in_flight + 1) · w_p / Σw)` over the
//! eligible peers (consistent hashing with bounded loads, weighted). Other policies share the
//! same slots so that they can be compared on equal terms.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::cluster::Cluster;
use super::slots::{PeerLoad, Slot, UNLIMITED};

pub const DEFAULT_BALANCE_FACTOR: f64 = 1.25;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Weighted rotation; skips peers at `max_in_flight`.
    RoundRobin,
    /// The peer with the fewest requests per unit of weight, under `max_in_flight`.
    LeastInFlight,
    /// Pure sticky hashing: the key's peer, however loaded.
    ConsistentHash,
    /// Sticky hashing that overflows clockwise past peers at their bound.
    BoundedConsistentHash,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastInFlight => "least_in_flight",
            Policy::ConsistentHash => "consistent_hash",
            Policy::BoundedConsistentHash => "bounded_consistent_hash",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Balance {
    pub policy: Policy,
    /// The `c` of the `(1+ε)` bound; `None` leaves only `max_in_flight`.
    pub balance_factor: Option<f64>,
}

impl Default for Balance {
    fn default() -> Self {
        Self {
            policy: Policy::BoundedConsistentHash,
            balance_factor: Some(DEFAULT_BALANCE_FACTOR),
        }
    }
}

/// How the chosen peer relates to the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// The key's own peer: the first eligible one on its walk.
    Primary,
    /// A later peer on the walk, because the ones before it were at their bound.
    Overflow,
    /// Chosen by load alone (round robin, least in flight, or a request with no key).
    Balanced,
}

impl Route {
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Primary => "primary",
            Route::Overflow => "overflow",
            Route::Balanced => "balanced",
        }
    }
}

#[derive(Debug)]
pub struct Routed {
    pub slot: Slot,
    pub route: Route,
    /// Distinct peers looked at, the chosen one included.
    pub steps: u32,
}

#[derive(Debug)]
pub enum Decision {
    Routed(Routed),
    /// Eligible peers exist but every one is at its bound.
    Saturated,
    /// No peer is eligible (none configured, all down, draining or excluded).
    NoPeer,
}

impl Decision {
    pub fn routed(self) -> Option<Routed> {
        match self {
            Decision::Routed(r) => Some(r),
            _ => None,
        }
    }
}

impl Cluster {
    /// Chooses a peer for a request whose key is `hash` (`None`: spread by load), skipping the
    /// peers in `excluded` (those that already failed this request), and takes its slot.
    pub fn select(
        &self,
        balance: &Balance,
        hash: Option<u64>,
        excluded: &[Arc<PeerLoad>],
    ) -> Decision {
        let usable =
            |p: &Arc<PeerLoad>| p.eligible() && !excluded.iter().any(|e| Arc::ptr_eq(e, p));
        match (balance.policy, hash) {
            (Policy::ConsistentHash, Some(h)) => self.walk_select(h, usable, |p| Some(p.take())),
            (Policy::BoundedConsistentHash, Some(h)) => {
                self.walk_select(h, usable, |p| p.try_take(self.bound(balance, p)))
            }
            (Policy::RoundRobin, _) => self.round_robin(usable),
            (Policy::LeastInFlight, _) | (_, None) => self.least_in_flight(usable),
        }
    }

    /// The in-flight ceiling of `peer` under `balance`: none for pure sticky hashing,
    /// `max_in_flight` for round robin and least in flight, and the smaller of that and the
    /// balance bound for bounded consistent hashing.
    pub fn bound(&self, balance: &Balance, peer: &PeerLoad) -> u32 {
        let fixed = match balance.policy {
            Policy::ConsistentHash => return UNLIMITED,
            Policy::RoundRobin | Policy::LeastInFlight => return peer.max_in_flight(),
            Policy::BoundedConsistentHash => peer.max_in_flight(),
        };
        let Some(c) = balance.balance_factor else {
            return fixed;
        };
        let total_weight = self.eligible_weight().max(1) as f64;
        let share = c * (self.in_flight() as f64 + 1.0) * f64::from(peer.weight()) / total_weight;
        // c ≥ 1 and in_flight + 1 ≥ 1 keep the share positive, so every bound is at least 1.
        fixed.min(share.ceil().min(f64::from(UNLIMITED)) as u32)
    }

    fn walk_select(
        &self,
        hash: u64,
        usable: impl Fn(&Arc<PeerLoad>) -> bool,
        take: impl Fn(&Arc<PeerLoad>) -> Option<Slot>,
    ) -> Decision {
        let (mut steps, mut candidates) = (0, 0);
        for idx in self.ring().walk(hash) {
            steps += 1;
            let peer = &self.peers()[idx];
            if !usable(peer) {
                continue;
            }
            candidates += 1;
            if let Some(slot) = take(peer) {
                let route = if candidates == 1 {
                    Route::Primary
                } else {
                    Route::Overflow
                };
                return Decision::Routed(Routed { slot, route, steps });
            }
        }
        if candidates == 0 {
            Decision::NoPeer
        } else {
            Decision::Saturated
        }
    }

    fn round_robin(&self, usable: impl Fn(&Arc<PeerLoad>) -> bool) -> Decision {
        let n = self.rotation.len();
        if n == 0 {
            return Decision::NoPeer;
        }
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let mut candidates = 0;
        for i in 0..n {
            let peer = &self.peers()[self.rotation[(start + i) % n] as usize];
            if !usable(peer) {
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

    fn least_in_flight(&self, usable: impl Fn(&Arc<PeerLoad>) -> bool) -> Decision {
        // A lost race for the least-loaded peer's last slot looks again; a few tries suffice,
        // since each lost race means another request made progress.
        for _ in 0..4 {
            let mut best: Option<&Arc<PeerLoad>> = None;
            let mut any = false;
            for peer in self.peers().iter().filter(|p| usable(p)) {
                any = true;
                if peer.in_flight() >= peer.max_in_flight() {
                    continue;
                }
                let lighter = best.is_none_or(|b| {
                    u64::from(peer.in_flight()) * u64::from(b.weight())
                        < u64::from(b.in_flight()) * u64::from(peer.weight())
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
}
