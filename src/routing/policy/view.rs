//! What a policy sees of the cluster for one request: the peers it may choose, the ring, the
//! prompt record, and the load the bound's mean is taken over. The cluster builds one per
//! decision from references: no copy, no lock.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::balance::{Balance, BoundInputs};
use super::decision::{Decision, Route, Routed};
use crate::routing::load::ClusterLoad;
use crate::routing::peer::Peer;
use crate::routing::pool::ModelId;
use crate::routing::record::PrefixRecord;
use crate::routing::ring::Ring;
use crate::routing::slot::Slot;

/// The peers that count in the bound's mean, as the cluster last refreshed them.
#[derive(Debug, Default)]
pub struct Eligible {
    /// Σ weight over the peers the walk may choose.
    weight: AtomicU64,
    /// Peers that carry requests but take no new ones (draining, down, ejected, removed): the
    /// bound leaves their load out, as it leaves their weight out.
    left_out: ArcSwap<Vec<Arc<Peer>>>,
    /// Whether `left_out` is not empty: the common case reads no more than this.
    any_left_out: AtomicBool,
}

impl Eligible {
    pub fn weight(&self) -> u64 {
        self.weight.load(Ordering::Relaxed)
    }

    /// Sets the eligible weight; returns the one before.
    pub fn swap_weight(&self, weight: u64) -> u64 {
        self.weight.swap(weight, Ordering::Relaxed)
    }

    pub fn set_left_out(&self, left_out: Vec<Arc<Peer>>) {
        let any = !left_out.is_empty();
        if any || self.any_left_out.load(Ordering::Relaxed) {
            self.left_out.store(Arc::new(left_out));
        }
        self.any_left_out.store(any, Ordering::Relaxed);
    }

    /// What the left-out peers still carry.
    fn left_out_load(&self) -> u64 {
        if !self.any_left_out.load(Ordering::Relaxed) {
            return 0;
        }
        self.left_out
            .load()
            .iter()
            .map(|p| u64::from(p.load()))
            .sum()
    }
}

/// A pool's load and weight, as its bound reads them.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolLoad {
    in_flight: u64,
    weight: u64,
}

impl PoolLoad {
    /// What the eligible peers serving `model` carry, and their weight.
    pub fn of(peers: &[Arc<Peer>], model: ModelId) -> Self {
        let mut pool = PoolLoad::default();
        for p in peers.iter().filter(|p| p.eligible() && p.serves(model)) {
            pool.in_flight += u64::from(p.load());
            pool.weight += u64::from(p.weight());
        }
        pool
    }
}

pub struct View<'a> {
    /// `peers[i]` is the peer of `ring.peers()[i]`.
    pub peers: &'a [Arc<Peer>],
    pub ring: &'a Ring,
    pub record: &'a PrefixRecord,
    /// Peer indices repeated by weight and interleaved, for round robin.
    pub rotation: &'a [u32],
    pub cursor: &'a AtomicUsize,
    pub load: &'a ClusterLoad,
    pub eligible: &'a Eligible,
    /// The request's pool, whose own load is the bound's mean; `None`: the eligible peers'.
    pub pool: Option<PoolLoad>,
    /// The model asked for: only peers serving it may be chosen.
    pub model: Option<ModelId>,
    /// Peers that already failed this request.
    pub excluded: &'a [Arc<Peer>],
}

impl View<'_> {
    /// Whether the request may go to `peer`: eligible, serving the model asked for, and not
    /// one that already failed it.
    pub fn usable(&self, peer: &Arc<Peer>) -> bool {
        peer.eligible()
            && self.model.is_none_or(|m| peer.serves(m))
            && !self.excluded.iter().any(|e| Arc::ptr_eq(e, peer))
    }

    /// The in-flight ceiling of `peer` under `balance`, in the cluster as it is now.
    pub fn bound(&self, balance: &Balance, peer: &Peer) -> u32 {
        balance.bound(self.bound_inputs(peer))
    }

    /// Its mean is over the eligible peers (or the pool's): their load over their weight.
    /// Counting what a draining or ejected peer still carries would raise every other peer's
    /// ceiling by that much.
    pub fn bound_inputs(&self, peer: &Peer) -> BoundInputs {
        let (total_in_flight, eligible_weight) = match self.pool {
            Some(pool) => (pool.in_flight, pool.weight),
            None => {
                let left_out = self.eligible.left_out_load();
                let total = self.load.in_flight() + self.load.external();
                (total.saturating_sub(left_out), self.eligible.weight())
            }
        };
        BoundInputs {
            max_in_flight: peer.max_in_flight(),
            weight: peer.weight(),
            total_in_flight,
            eligible_weight,
            capacity: peer.capacity(),
            home: false,
        }
    }

    /// The first usable peer of `walk` that `take` gives a slot on; `seen` usable peers came
    /// before the walk (priced, and full).
    pub fn walk_select(
        &self,
        walk: impl Iterator<Item = usize>,
        seen: u32,
        take: impl Fn(&Arc<Peer>) -> Option<Slot>,
    ) -> Decision {
        let (mut steps, mut candidates) = (seen, seen);
        for idx in walk {
            steps += 1;
            let peer = &self.peers[idx];
            if !self.usable(peer) {
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
}
