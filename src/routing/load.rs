//! The counts behind every ceiling: what a router has in flight across its peers, and the load
//! others carry on one peer (the other processes of an upgrade, the engine's excess).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use super::pool::ModelId;
use super::queue::WaitLines;

/// Load shared by every peer of a router, across ring rebuilds.
#[derive(Debug, Default)]
pub struct ClusterLoad {
    in_flight: AtomicU64,
    /// Σ of the peers' load carried by others ([`Others::get`]).
    external: AtomicU64,
    /// Whether other processes of an upgrade share their counts now. Their counts are exact and
    /// take turns with this process's; an engine's lag a scrape behind, and would let one
    /// process's waiters take every slot the other's requests give back.
    siblings: AtomicBool,
    /// The waiting lines, one per pool: the model asked for (`None`: any peer).
    waiters: WaitLines<Option<ModelId>>,
    /// The prefill rate the peers have shown, as `f64` bits (0: none yet): what a peer that
    /// has not shown its own is priced at. Peers behind one balancer are mostly alike, and a
    /// peer priced at the configured guess beside siblings priced at their true rate would win
    /// or lose every comparison on that difference alone.
    rate: AtomicU64,
}

impl ClusterLoad {
    /// The peers' prefill rate, once one has shown its own.
    pub fn prefill_rate(&self) -> Option<f64> {
        match self.rate.load(Ordering::Relaxed) {
            0 => None,
            bits => Some(f64::from_bits(bits)),
        }
    }

    /// Folds a rate one peer has shown into the peers' rate (an EWMA over the last updates).
    pub fn learned_rate(&self, rate: f64) {
        let _ = self
            .rate
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let mean = match bits {
                    0 => rate,
                    bits => (f64::from_bits(bits) * 7.0 + rate) / 8.0,
                };
                Some(mean.to_bits())
            });
    }

    /// Requests this router has in flight.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests on these peers that others carry.
    pub fn external(&self) -> u64 {
        self.external.load(Ordering::Relaxed)
    }

    /// Says whether other processes share their counts (see [`Others::set_from_siblings`]).
    pub fn set_siblings(&self, present: bool) {
        self.siblings.store(present, Ordering::Relaxed);
    }

    /// Requests waiting for a slot, a line per pool; every release wakes the first of each.
    pub fn waiters(&self) -> &WaitLines<Option<ModelId>> {
        &self.waiters
    }

    /// A slot was taken on one of the peers.
    pub(crate) fn took(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A slot was given back: the first waiter of a line may take it.
    pub(crate) fn released(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.waiters.wake_fronts();
    }
}

/// The load others carry on one peer: the larger of two estimates, since both count, in part,
/// the same requests.
#[derive(Debug, Default)]
pub struct Others {
    external: AtomicU32,
    /// What the other prefixlb processes of an upgrade carry here, as they publish it.
    from_siblings: AtomicU32,
    /// What the engine says it has (running and waiting) beyond this process's own requests.
    from_engine: AtomicU32,
}

impl Others {
    pub fn get(&self) -> u32 {
        self.external.load(Ordering::Acquire)
    }

    pub fn set_from_siblings(&self, load: u32, cluster: &ClusterLoad) {
        self.from_siblings.store(load, Ordering::Relaxed);
        self.update(cluster);
    }

    pub fn set_from_engine(&self, load: u32, cluster: &ClusterLoad) {
        self.from_engine.store(load, Ordering::Relaxed);
        self.update(cluster);
    }

    /// Forgets both estimates: the peer is routed to no more, and nothing will update them.
    pub fn clear(&self, cluster: &ClusterLoad) {
        self.from_siblings.store(0, Ordering::Relaxed);
        self.from_engine.store(0, Ordering::Relaxed);
        self.update(cluster);
    }

    fn update(&self, cluster: &ClusterLoad) {
        let siblings = self.from_siblings.load(Ordering::Relaxed);
        let external = if cluster.siblings.load(Ordering::Relaxed) {
            siblings
        } else {
            siblings.max(self.from_engine.load(Ordering::Relaxed))
        };
        let before = self.external.swap(external, Ordering::AcqRel);
        let total = &cluster.external;
        total.fetch_add(u64::from(external), Ordering::Relaxed);
        total.fetch_sub(u64::from(before), Ordering::Relaxed);
        // Room that others' load gave back is capacity nobody else announces.
        if external < before {
            cluster.waiters.wake_fronts();
        }
    }
}
