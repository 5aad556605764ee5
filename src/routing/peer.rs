//! The live peer: what it carries, what it may carry, whether it may be chosen, and the RAII
//! [`Slot`] that counts one request on it.
//!
//! A [`Peer`] is keyed by its address and outlives any one ring: a rebuild hands the same `Arc`
//! to the new ring, so a peer that stays keeps its count, and a removed peer's count drains
//! through the slots that still hold it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;

use super::cost::Pricing;
use super::outlier::{Outlier, OutlierPolicy};
use super::pool::{ModelId, ModelNames};
use super::queue::WaitQueue;

/// The largest weight a peer may have: weights are relative, and this bounds a peer's ring
/// points (weight × vnodes, 12 bytes each) and its share of the round-robin rotation.
pub const MAX_WEIGHT: u32 = 100;

/// `max_in_flight` of a peer that has no fixed ceiling.
pub const UNLIMITED: u32 = u32::MAX;

/// A peer's relative share of keys and load: from 1 to [`MAX_WEIGHT`], by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Weight(u8);

impl Weight {
    pub const ONE: Weight = Weight(1);

    /// `None` outside 1..=[`MAX_WEIGHT`].
    pub fn new(weight: u32) -> Option<Self> {
        (1..=MAX_WEIGHT)
            .contains(&weight)
            .then_some(Weight(weight as u8))
    }

    /// The nearest weight, for weights set by others (SRV records, Pingora backends) where
    /// refusing the peer would be worse than bounding it.
    pub fn clamped(weight: u64) -> Self {
        Weight(weight.clamp(1, u64::from(MAX_WEIGHT)) as u8)
    }

    pub fn get(self) -> u32 {
        u32::from(self.0)
    }
}

/// One peer as configured or discovered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    pub addr: SocketAddr,
    pub weight: Weight,
    /// The fixed in-flight ceiling; [`UNLIMITED`] for none.
    pub max_in_flight: u32,
    /// Reached over TLS, its certificate checked for this name; `None`: plain HTTP.
    pub tls: Option<String>,
    /// The models it serves (base models and adapters); `None`: any.
    pub models: Option<Vec<String>>,
}

/// Peers in address order, each address once (the first listing wins): the one order every
/// cluster and every comparison of peer lists uses.
pub fn canonical(mut specs: Vec<PeerSpec>) -> Vec<PeerSpec> {
    specs.sort_by_key(|s| s.addr);
    specs.dedup_by_key(|s| s.addr);
    specs
}

/// Load shared by every peer of a router, across ring rebuilds.
#[derive(Debug, Default)]
pub struct ClusterLoad {
    in_flight: AtomicU64,
    /// Σ of the peers' [`Peer::external`] load.
    external: AtomicU64,
    /// Whether other processes of an upgrade share their counts now. Their counts are exact and
    /// take turns with this process's; an engine's lag a scrape behind, and would let one
    /// process's waiters take every slot the other's requests give back.
    siblings: AtomicBool,
    waiters: WaitQueue,
}

impl ClusterLoad {
    /// Requests this router has in flight.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests on these peers that others carry (see [`Peer::external`]).
    pub fn external(&self) -> u64 {
        self.external.load(Ordering::Relaxed)
    }

    /// Says whether other processes share their counts (see [`Peer::set_external`]).
    pub fn set_siblings(&self, present: bool) {
        self.siblings.store(present, Ordering::Relaxed);
    }

    /// Requests waiting for a slot; every release wakes the first of them.
    pub fn waiters(&self) -> &WaitQueue {
        &self.waiters
    }
}

/// The models a peer lists, as written and interned.
#[derive(Debug)]
struct Served {
    names: Vec<String>,
    ids: Vec<ModelId>,
}

/// Serials start at 1: 0 marks an empty way of the prompt record.
static SERIALS: AtomicU32 = AtomicU32::new(1);

#[derive(Debug)]
pub struct Peer {
    addr: SocketAddr,
    id: String,
    /// Unique in the process and kept across rebuilds: what the prompt record names.
    serial: u32,
    weight: AtomicU8,
    max_in_flight: AtomicU32,
    /// The name its certificate is checked for, when it is reached over TLS.
    tls: ArcSwapOption<String>,
    /// The models it lists, by name and id; `None`: it lists none and serves any.
    models: ArcSwapOption<Served>,
    in_flight: AtomicU32,
    /// The larger of the two estimates below: both count, in part, the same requests.
    external: AtomicU32,
    /// What the other prefixlb processes of an upgrade carry here, as they publish it.
    from_siblings: AtomicU32,
    /// What the engine says it has (running and waiting) beyond this process's own requests.
    from_engine: AtomicU32,
    engine: EngineFigures,
    /// The most requests the engine has run at once, once it has been seen to queue (0 until
    /// then): beyond it a request waits for a running slot.
    capacity: AtomicU32,
    /// Prompt tokens this process expects the peer still to prefill: its requests' uncached
    /// estimates, from the choice to the first byte of the answer.
    prefill_queue: AtomicU64,
    /// Mean time a request streams its answer, from first byte to end, in microseconds (an
    /// EWMA; 0 until one has ended).
    decode_us: AtomicU32,
    healthy: AtomicBool,
    draining: AtomicBool,
    removed: AtomicBool,
    outlier: Outlier,
    cluster: Arc<ClusterLoad>,
}

impl Peer {
    pub fn new(spec: &PeerSpec, cluster: Arc<ClusterLoad>) -> Self {
        Self {
            addr: spec.addr,
            id: spec.addr.to_string(),
            weight: AtomicU8::new(spec.weight.0),
            max_in_flight: AtomicU32::new(spec.max_in_flight),
            tls: ArcSwapOption::from(spec.tls.clone().map(Arc::new)),
            models: ArcSwapOption::empty(),
            in_flight: AtomicU32::new(0),
            external: AtomicU32::new(0),
            from_siblings: AtomicU32::new(0),
            from_engine: AtomicU32::new(0),
            serial: SERIALS.fetch_add(1, Ordering::Relaxed),
            engine: EngineFigures::default(),
            capacity: AtomicU32::new(0),
            prefill_queue: AtomicU64::new(0),
            decode_us: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            outlier: Outlier::default(),
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
    pub fn serial(&self) -> u32 {
        self.serial
    }
    pub fn weight(&self) -> u32 {
        u32::from(self.weight.load(Ordering::Relaxed))
    }
    pub fn max_in_flight(&self) -> u32 {
        self.max_in_flight.load(Ordering::Relaxed)
    }
    /// The name to check the peer's certificate for, when it is reached over TLS.
    pub fn tls(&self) -> Option<Arc<String>> {
        self.tls.load_full()
    }
    /// The models it lists; `None`: it serves any.
    pub fn models(&self) -> Option<Vec<String>> {
        self.models.load().as_ref().map(|m| m.names.clone())
    }
    /// Whether it serves `model`.
    pub fn serves(&self, model: ModelId) -> bool {
        super::pool::serves(self.models.load().as_ref().map(|m| &m.ids[..]), model)
    }
    /// Requests this router has in flight on the peer.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Acquire)
    }
    /// Requests on the peer that others carry: the other prefixlb processes of an upgrade.
    /// Every ceiling counts them.
    pub fn external(&self) -> u32 {
        self.external.load(Ordering::Acquire)
    }
    /// Everything the peer carries: [`Peer::in_flight`] and [`Peer::external`].
    pub fn load(&self) -> u32 {
        self.in_flight().saturating_add(self.external())
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
    pub fn ejected(&self) -> bool {
        self.outlier.ejected()
    }
    /// Running slots the engine has shown it has; 0 while unknown.
    pub fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Relaxed)
    }
    /// Prompt tokens of this process's requests the peer has yet to prefill (estimated).
    pub fn prefill_queue(&self) -> u64 {
        self.prefill_queue.load(Ordering::Relaxed)
    }
    /// How long a request streams its answer here, on average; `None` before one has ended.
    pub fn decode_time(&self) -> Option<Duration> {
        match self.decode_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(u64::from(us))),
        }
    }

    /// What the cost rule believes of the peer now, for a prompt it holds `hit` of.
    pub fn pricing(&self, hit: f64) -> Pricing {
        Pricing {
            load: self.load(),
            capacity: self.capacity(),
            prefill_queue: self.prefill_queue(),
            decode: self.decode_time(),
            hit,
        }
    }

    /// The peer as it is configured now.
    pub fn spec(&self) -> PeerSpec {
        PeerSpec {
            addr: self.addr,
            weight: Weight(self.weight.load(Ordering::Relaxed)),
            max_in_flight: self.max_in_flight(),
            tls: self.tls().map(|name| name.as_str().to_owned()),
            models: self.models(),
        }
    }

    /// Healthy, not draining, not ejected and still a member: the walk may choose it.
    pub fn eligible(&self) -> bool {
        self.healthy() && !self.draining() && !self.removed() && !self.ejected()
    }

    /// A request to this peer got an answer that is not a server error.
    pub fn record_success(&self) {
        self.outlier.record_success();
    }

    /// A request to this peer failed to connect or got a gateway answer. Returns the ejection it
    /// caused, if it caused one (and `may_eject` allowed one).
    pub fn record_failure(&self, policy: &OutlierPolicy, may_eject: bool) -> Option<Duration> {
        self.outlier.record_failure(policy, may_eject)
    }

    pub(super) fn set_limits(&self, spec: &PeerSpec) {
        self.weight.store(spec.weight.0, Ordering::Relaxed);
        self.max_in_flight
            .store(spec.max_in_flight, Ordering::Relaxed);
        if self.tls.load().as_deref() != spec.tls.as_ref() {
            self.tls.store(spec.tls.clone().map(Arc::new));
        }
    }
    pub(super) fn set_models(&self, names: Option<&Vec<String>>, pool_names: &ModelNames) {
        if self.models().as_ref() != names {
            self.models.store(names.map(|n| {
                Arc::new(Served {
                    names: n.clone(),
                    ids: pool_names.intern(n),
                })
            }));
        }
    }
    pub(super) fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }
    pub(super) fn set_draining(&self, draining: bool) {
        self.draining.store(draining, Ordering::Relaxed);
    }
    pub(super) fn set_removed(&self, removed: bool) {
        self.removed.store(removed, Ordering::Relaxed);
    }
    pub(super) fn set_external(&self, external: u32) {
        self.from_siblings.store(external, Ordering::Relaxed);
        self.update_external();
    }

    /// What the engine reported on its last scrape, `None` when that scrape failed: the
    /// requests it has beyond this process's own count as load carried by others.
    pub fn set_engine(&self, figures: Option<EngineReport>) {
        let excess = figures.map_or(0, |f| {
            (f.running + f.waiting).saturating_sub(self.in_flight())
        });
        if let Some(f) = figures {
            // Only a queue proves the engine full; until one is seen its capacity is unknown,
            // and what it runs says nothing of what it could.
            let known = self.capacity();
            let capacity = if f.waiting > 0 {
                f.running.max(1)
            } else if known > 0 {
                known.max(f.running)
            } else {
                0
            };
            self.capacity.store(capacity, Ordering::Relaxed);
        }
        self.engine.set(figures);
        self.from_engine.store(excess, Ordering::Relaxed);
        self.update_external();
    }

    /// The engine's last figures and how old they are, if the last scrape gave any.
    pub fn engine(&self) -> Option<(EngineReport, Duration)> {
        self.engine.get()
    }

    fn update_external(&self) {
        let siblings = self.from_siblings.load(Ordering::Relaxed);
        let external = if self.cluster.siblings.load(Ordering::Relaxed) {
            siblings
        } else {
            siblings.max(self.from_engine.load(Ordering::Relaxed))
        };
        let before = self.external.swap(external, Ordering::AcqRel);
        let total = &self.cluster.external;
        total.fetch_add(u64::from(external), Ordering::Relaxed);
        total.fetch_sub(u64::from(before), Ordering::Relaxed);
        // Room that others' load gave back is capacity nobody else announces.
        if external < before {
            self.cluster.waiters.wake_front();
        }
    }

    /// Takes a slot if the peer carries fewer than `bound` requests, its external load
    /// included. The check and the increment are one compare-and-swap, so concurrent takers can
    /// never push the count past `bound`.
    pub fn try_take(self: &Arc<Self>, bound: u32) -> Option<Slot> {
        let room = bound.saturating_sub(self.external());
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < room).then_some(n + 1)
            })
            .ok()?;
        self.cluster.in_flight.fetch_add(1, Ordering::Relaxed);
        Some(Slot::new(self))
    }

    /// Takes a slot with no ceiling (pure sticky hashing).
    pub fn take(self: &Arc<Self>) -> Slot {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.cluster.in_flight.fetch_add(1, Ordering::Relaxed);
        Slot::new(self)
    }

    fn record_decode(&self, held: Duration) {
        let sample = held.as_micros().clamp(1, u128::from(u32::MAX)) as u32;
        // An EWMA over about the last eight requests: recent enough to follow a change of
        // workload, smooth enough that one long answer does not swing it.
        let _ = self
            .decode_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |mean| {
                Some(if mean == 0 {
                    sample
                } else {
                    ((u64::from(mean) * 7 + u64::from(sample)) / 8) as u32
                })
            });
    }
}

/// What an engine says of itself on its metrics endpoint (vLLM's or SGLang's names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineReport {
    pub running: u32,
    pub waiting: u32,
    /// KV cache in use, 0 to 1, when the engine reports it.
    pub kv_cache_usage: Option<f64>,
}

/// The last [`EngineReport`] of a peer and when it came; read by the admin API and metrics,
/// written by the scraper: off the request path, so a lock is fine.
#[derive(Debug, Default)]
struct EngineFigures(std::sync::Mutex<Option<(EngineReport, std::time::Instant)>>);

impl EngineFigures {
    fn set(&self, figures: Option<EngineReport>) {
        let mut last = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *last = figures.map(|f| (f, std::time::Instant::now()));
    }

    fn get(&self) -> Option<(EngineReport, Duration)> {
        let last = self.0.lock().unwrap_or_else(|p| p.into_inner());
        last.map(|(f, at)| (f, at.elapsed()))
    }
}

/// One in-flight request on one peer. Dropping it releases the slot, exactly once, and with
/// it whatever prefill it still had counted.
#[derive(Debug)]
pub struct Slot {
    peer: Arc<Peer>,
    /// Tokens this request adds to the peer's prefill queue until its first byte.
    prefill: u64,
    /// Whether the request carries a prompt: only those time the peer's decode (a model list
    /// answered at once would pull the mean down).
    priced: bool,
    /// When the first byte of the answer came, for the peer's decode time.
    since: Option<Instant>,
}

impl Slot {
    fn new(peer: &Arc<Peer>) -> Self {
        Self {
            peer: Arc::clone(peer),
            prefill: 0,
            priced: false,
            since: None,
        }
    }

    pub fn peer(&self) -> &Arc<Peer> {
        &self.peer
    }

    /// Counts `tokens` of prompt the peer must prefill for this request, until
    /// [`Slot::prefilled`] or the end.
    pub fn expect_prefill(&mut self, tokens: u64) {
        self.peer.prefill_queue.fetch_add(tokens, Ordering::Relaxed);
        self.prefill += tokens;
        self.priced = true;
    }

    /// The first byte of the answer came: the prompt is prefilled, and the answer streams
    /// until the slot is dropped.
    pub fn prefilled(&mut self) {
        self.release_prefill();
        if self.priced {
            self.since.get_or_insert_with(Instant::now);
        }
    }

    fn release_prefill(&mut self) {
        let tokens = std::mem::take(&mut self.prefill);
        self.peer.prefill_queue.fetch_sub(tokens, Ordering::Relaxed);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.release_prefill();
        if let Some(since) = self.since {
            self.peer.record_decode(since.elapsed());
        }
        self.peer.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.peer.cluster.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.peer.cluster.waiters.wake_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(max: u32) -> Arc<Peer> {
        let spec = PeerSpec {
            addr: "127.0.0.1:1".parse().unwrap(),
            weight: Weight::ONE,
            max_in_flight: max,
            tls: None,
            models: None,
        };
        Arc::new(Peer::new(&spec, Arc::default()))
    }

    #[test]
    fn weight_holds_its_range_by_construction() {
        assert_eq!(Weight::new(0), None);
        assert_eq!(Weight::new(101), None);
        assert_eq!(Weight::new(100).map(Weight::get), Some(100));
        assert_eq!(Weight::clamped(0).get(), 1);
        assert_eq!(Weight::clamped(65_535).get(), MAX_WEIGHT);
    }

    #[test]
    fn canonical_sorts_and_keeps_the_first_of_each_address() {
        let at = |port: u16, w: u32| PeerSpec {
            addr: ([127, 0, 0, 1], port).into(),
            weight: Weight::new(w).unwrap(),
            max_in_flight: UNLIMITED,
            tls: None,
            models: None,
        };
        assert_eq!(
            canonical(vec![at(3, 1), at(1, 2), at(3, 5)]),
            vec![at(1, 2), at(3, 1)]
        );
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
    fn only_prompts_time_the_decode() {
        let p = peer(4);
        let mut light = p.take();
        light.prefilled();
        drop(light);
        assert_eq!(p.decode_time(), None, "a model list timed the decode");
        let mut prompt = p.take();
        prompt.expect_prefill(100);
        assert_eq!(p.prefill_queue(), 100);
        prompt.prefilled();
        assert_eq!(p.prefill_queue(), 0);
        drop(prompt);
        assert!(p.decode_time().is_some());
    }

    #[test]
    fn external_load_counts_against_every_ceiling() {
        let p = peer(3);
        p.set_external(2);
        assert_eq!(p.cluster.external(), 2);
        let a = p.try_take(3).unwrap();
        assert!(
            p.try_take(3).is_none(),
            "2 elsewhere + 1 here = the ceiling"
        );
        assert_eq!(p.load(), 3);
        p.set_external(0);
        assert_eq!(p.cluster.external(), 0);
        let b = p.try_take(3).unwrap();
        drop((a, b));
        p.set_external(7);
        assert!(p.try_take(3).is_none(), "more elsewhere than the ceiling");
    }

    #[test]
    fn an_ejected_peer_is_not_eligible() {
        let p = peer(4);
        let policy = OutlierPolicy {
            consecutive_failures: 1,
            ..OutlierPolicy::default()
        };
        assert!(p.eligible());
        assert!(p.record_failure(&policy, true).is_some());
        assert!(p.ejected() && !p.eligible());
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
