//! In-flight accounting: one atomic counter per peer, taken with a compare-and-swap against the
//! peer's bound and released by an RAII guard.
//!
//! A [`PeerLoad`] is keyed by the peer's identity and outlives any one ring: a rebuild hands the
//! same `Arc` to the new ring, so a peer that stays keeps its count, and a removed peer's count
//! drains through the [`Slot`]s that still hold it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::queue::WaitQueue;

/// Load shared by every peer of a router, across ring rebuilds.
#[derive(Debug)]
pub struct ClusterLoad {
    in_flight: AtomicU64,
    waiters: WaitQueue,
    epoch: Instant,
}

impl Default for ClusterLoad {
    fn default() -> Self {
        Self {
            in_flight: AtomicU64::new(0),
            waiters: WaitQueue::default(),
            epoch: Instant::now(),
        }
    }
}

impl ClusterLoad {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests waiting for a slot; every release wakes the first of them.
    pub fn waiters(&self) -> &WaitQueue {
        &self.waiters
    }
}

/// The live state of one peer: what it carries, what it may carry, and whether it may be chosen.
#[derive(Debug)]
pub struct PeerLoad {
    addr: SocketAddr,
    id: String,
    weight: AtomicU32,
    max_in_flight: AtomicU32,
    in_flight: AtomicU32,
    healthy: AtomicBool,
    draining: AtomicBool,
    removed: AtomicBool,
    /// Passive outlier state: consecutive failures, consecutive ejections (the backoff
    /// exponent; above 0 the peer is on probation) and when the current ejection ends.
    failures: AtomicU32,
    ejections: AtomicU32,
    ejected: AtomicBool,
    ejected_until_ms: AtomicU64,
    cluster: Arc<ClusterLoad>,
}

/// When to eject a peer that keeps failing, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutlierPolicy {
    /// Consecutive failures (connect errors, 5xx) that eject a peer; 0 never ejects.
    pub consecutive_failures: u32,
    /// The first ejection; each one that follows a failed probe lasts twice as long.
    pub base_ejection: Duration,
    pub max_ejection: Duration,
}

impl Default for OutlierPolicy {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(5),
            max_ejection: Duration::from_secs(300),
        }
    }
}

/// `max_in_flight` of a peer that has no fixed ceiling.
pub const UNLIMITED: u32 = u32::MAX;

impl PeerLoad {
    pub fn new(
        addr: SocketAddr,
        weight: u32,
        max_in_flight: u32,
        cluster: Arc<ClusterLoad>,
    ) -> Self {
        Self {
            addr,
            id: addr.to_string(),
            weight: AtomicU32::new(weight.max(1)),
            max_in_flight: AtomicU32::new(max_in_flight),
            in_flight: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected: AtomicBool::new(false),
            ejected_until_ms: AtomicU64::new(0),
            cluster,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
    /// The peer's identity: its address, as text.
    pub fn id(&self) -> &str {
        &self.id
    }
    pub fn weight(&self) -> u32 {
        self.weight.load(Ordering::Relaxed)
    }
    pub fn max_in_flight(&self) -> u32 {
        self.max_in_flight.load(Ordering::Relaxed)
    }
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Acquire)
    }
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
    pub fn removed(&self) -> bool {
        self.removed.load(Ordering::Relaxed)
    }

    /// The peer as it is configured now.
    pub fn spec(&self) -> super::cluster::PeerSpec {
        super::cluster::PeerSpec {
            addr: self.addr,
            weight: self.weight(),
            max_in_flight: self.max_in_flight(),
        }
    }

    /// Healthy, not draining, not ejected and still a member: the walk may choose it.
    pub fn eligible(&self) -> bool {
        self.healthy() && !self.draining() && !self.removed() && !self.ejected()
    }

    /// Ejected for failing, and the ejection has not run out. Once it has, the peer takes
    /// requests again on probation: its next failure ejects it again, for twice as long.
    pub fn ejected(&self) -> bool {
        if !self.ejected.load(Ordering::Relaxed) {
            return false;
        }
        if self.cluster.now_ms() < self.ejected_until_ms.load(Ordering::Relaxed) {
            return true;
        }
        self.ejected.store(false, Ordering::Relaxed);
        false
    }

    /// A request to this peer got an answer that is not a server error.
    pub fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if !self.ejected() {
            self.ejections.store(0, Ordering::Relaxed);
        }
    }

    /// A request to this peer failed to connect or got a 5xx. Returns the ejection it
    /// caused, if it caused one.
    pub fn record_failure(&self, policy: &OutlierPolicy) -> Option<Duration> {
        if policy.consecutive_failures == 0 || self.ejected() {
            return None;
        }
        let on_probation = self.ejections.load(Ordering::Relaxed) > 0;
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if !on_probation && failures < policy.consecutive_failures {
            return None;
        }
        self.failures.store(0, Ordering::Relaxed);
        let exponent = self.ejections.fetch_add(1, Ordering::Relaxed).min(16);
        let backoff = policy
            .base_ejection
            .saturating_mul(1 << exponent)
            .min(policy.max_ejection);
        let until = self.cluster.now_ms() + backoff.as_millis() as u64;
        self.ejected_until_ms.store(until, Ordering::Relaxed);
        self.ejected.store(true, Ordering::Relaxed);
        Some(backoff)
    }

    pub(crate) fn set_limits(&self, weight: u32, max_in_flight: u32) {
        self.weight.store(weight.max(1), Ordering::Relaxed);
        self.max_in_flight.store(max_in_flight, Ordering::Relaxed);
    }
    pub(crate) fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }
    pub(crate) fn set_draining(&self, draining: bool) {
        self.draining.store(draining, Ordering::Relaxed);
    }
    pub(crate) fn set_removed(&self, removed: bool) {
        self.removed.store(removed, Ordering::Relaxed);
    }

    /// Takes a slot if the peer carries fewer than `bound` requests. The check and the increment
    /// are one compare-and-swap, so concurrent takers can never push the count past `bound`.
    pub fn try_take(self: &Arc<Self>, bound: u32) -> Option<Slot> {
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bound).then_some(n + 1)
            })
            .ok()?;
        self.cluster.in_flight.fetch_add(1, Ordering::Relaxed);
        Some(Slot {
            peer: Arc::clone(self),
        })
    }

    /// Takes a slot with no ceiling (pure sticky hashing).
    pub fn take(self: &Arc<Self>) -> Slot {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.cluster.in_flight.fetch_add(1, Ordering::Relaxed);
        Slot {
            peer: Arc::clone(self),
        }
    }
}

/// One in-flight request on one peer. Dropping it releases the slot, exactly once.
#[derive(Debug)]
pub struct Slot {
    peer: Arc<PeerLoad>,
}

impl Slot {
    pub fn peer(&self) -> &Arc<PeerLoad> {
        &self.peer
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.peer.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.peer.cluster.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.peer.cluster.waiters.wake_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(max: u32) -> Arc<PeerLoad> {
        Arc::new(PeerLoad::new(
            "127.0.0.1:1".parse().unwrap(),
            1,
            max,
            Arc::default(),
        ))
    }

    #[test]
    fn take_stops_at_bound_and_drop_releases_once() {
        let p = peer(2);
        let a = p.try_take(2).unwrap();
        let b = p.try_take(2).unwrap();
        assert!(p.try_take(2).is_none());
        assert_eq!(p.cluster.in_flight(), 2);
        drop(a);
        assert_eq!(p.in_flight(), 1);
        let c = p.try_take(2).unwrap();
        drop((b, c));
        assert_eq!(p.in_flight(), 0);
        assert_eq!(p.cluster.in_flight(), 0);
    }

    #[test]
    fn repeated_failures_eject_with_growing_backoff_and_success_clears() {
        let p = peer(4);
        let policy = OutlierPolicy {
            consecutive_failures: 3,
            base_ejection: Duration::from_millis(40),
            max_ejection: Duration::from_millis(100),
        };
        assert_eq!(p.record_failure(&policy), None);
        p.record_success();
        assert_eq!(p.record_failure(&policy), None);
        assert_eq!(p.record_failure(&policy), None);
        assert_eq!(p.record_failure(&policy), Some(Duration::from_millis(40)));
        assert!(p.ejected() && !p.eligible());
        assert_eq!(
            p.record_failure(&policy),
            None,
            "an ejected peer gets no requests to fail"
        );
        std::thread::sleep(Duration::from_millis(50));
        assert!(p.eligible(), "probed again once the ejection ran out");
        // On probation one failure ejects again, for twice as long, capped.
        assert_eq!(p.record_failure(&policy), Some(Duration::from_millis(80)));
        std::thread::sleep(Duration::from_millis(90));
        assert_eq!(p.record_failure(&policy), Some(Duration::from_millis(100)));
        std::thread::sleep(Duration::from_millis(110));
        p.record_success();
        assert_eq!(p.record_failure(&policy), None, "a success ends probation");
    }

    #[test]
    fn bound_holds_under_eight_threads() {
        let p = peer(5);
        let peak = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (p, peak) = (Arc::clone(&p), Arc::clone(&peak));
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..20_000u32 {
                        if let Some(s) = p.try_take(5) {
                            peak.fetch_max(p.in_flight(), Ordering::Relaxed);
                            held.push(s);
                        }
                        if i % 3 == 0 {
                            held.pop();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(Ordering::Relaxed) <= 5);
        assert!(peak.load(Ordering::Relaxed) >= 1);
        assert_eq!(p.in_flight(), 0);
        assert_eq!(p.cluster.in_flight(), 0);
    }
}
