//! The live peer: what it carries, what it may carry, whether it may be chosen, and the RAII
//! [`Slot`] that counts one request on it. A [`Peer`] is keyed by its address and outlives any
//! one ring: a rebuild hands the same `Arc` to the new ring, so a peer that stays keeps its
//! count, and a removed peer's count drains through the slots that still hold it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;

use super::cost::Pricing;
use super::engine::{Engine, EngineReport};
use super::load::{ClusterLoad, Others};
use super::outlier::{Outlier, OutlierPolicy};
use super::pool::{serves, Listed, ModelId, ModelNames};
use super::spec::{PeerSpec, Weight};

/// Serials start at 1: 0 marks an empty way of the prompt record.
static SERIALS: AtomicU32 = AtomicU32::new(1);

#[derive(Debug)]
pub struct Peer {
    addr: SocketAddr,
    id: String,
    /// Unique in the process and kept across rebuilds: what the prompt record names.
    serial: u32,
    weight: AtomicU32,
    max_in_flight: AtomicU32,
    /// The name its certificate is checked for, when it is reached over TLS.
    tls: ArcSwapOption<String>,
    /// The models it lists, by name and id; `None`: it lists none and serves any.
    models: ArcSwapOption<Listed>,
    in_flight: AtomicU32,
    others: Others,
    engine: Engine,
    /// Prompt tokens this process expects the peer still to prefill: its requests' uncached
    /// estimates, from the choice to the first byte of the answer.
    prefill_queue: AtomicU64,
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
            weight: AtomicU32::new(spec.weight.get()),
            max_in_flight: AtomicU32::new(spec.max_in_flight),
            tls: ArcSwapOption::from(spec.tls.clone().map(Arc::new)),
            models: ArcSwapOption::empty(),
            in_flight: AtomicU32::new(0),
            others: Others::default(),
            serial: SERIALS.fetch_add(1, Ordering::Relaxed),
            engine: Engine::default(),
            prefill_queue: AtomicU64::new(0),
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
        self.weight.load(Ordering::Relaxed)
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
        self.models.load().as_ref().map(|m| m.names().to_vec())
    }
    /// Whether it serves `model`.
    pub fn serves(&self, model: ModelId) -> bool {
        serves(self.models.load().as_ref().map(|m| m.ids()), model)
    }
    /// Requests this router has in flight on the peer.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Acquire)
    }
    /// Requests on the peer that others carry: the other prefixlb processes of an upgrade.
    /// Every ceiling counts them.
    pub fn external(&self) -> u32 {
        self.others.get()
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
        self.engine.capacity()
    }
    /// Prompt tokens of this process's requests the peer has yet to prefill (estimated).
    pub fn prefill_queue(&self) -> u64 {
        self.prefill_queue.load(Ordering::Relaxed)
    }
    /// How long a request streams its answer here, on average; `None` before one has ended.
    pub fn decode_time(&self) -> Option<Duration> {
        self.engine.decode_time()
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
            weight: Weight::clamped(u64::from(self.weight())),
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

    pub(crate) fn set_limits(&self, spec: &PeerSpec) {
        self.weight.store(spec.weight.get(), Ordering::Relaxed);
        self.max_in_flight
            .store(spec.max_in_flight, Ordering::Relaxed);
        if self.tls.load().as_deref() != spec.tls.as_ref() {
            self.tls.store(spec.tls.clone().map(Arc::new));
        }
    }
    pub(crate) fn set_models(&self, names: Option<&Vec<String>>, pool_names: &ModelNames) {
        if self.models().as_ref() != names {
            self.models
                .store(names.map(|n| Arc::new(Listed::new(n, pool_names))));
        }
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
    pub(crate) fn set_external(&self, external: u32) {
        self.others.set_from_siblings(external, &self.cluster);
    }

    /// What the engine reported on its last scrape, `None` when that scrape failed: the
    /// requests it has beyond this process's own count as load carried by others.
    pub fn set_engine(&self, figures: Option<EngineReport>) {
        let excess = figures.map_or(0, |f| {
            (f.running + f.waiting).saturating_sub(self.in_flight())
        });
        self.engine.report(figures);
        self.others.set_from_engine(excess, &self.cluster);
    }

    /// The engine's last figures and how old they are, if the last scrape gave any.
    pub fn engine(&self) -> Option<(EngineReport, Duration)> {
        self.engine.last()
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
        self.cluster.took();
        Some(Slot::new(self))
    }

    /// Takes a slot with no ceiling (pure sticky hashing).
    pub fn take(self: &Arc<Self>) -> Slot {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.cluster.took();
        Slot::new(self)
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
            self.peer.engine.record_decode(since.elapsed());
        }
        self.peer.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.peer.cluster.released();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(max: u32) -> Arc<Peer> {
        let spec = PeerSpec::new("127.0.0.1:1".parse().unwrap()).max_in_flight(max);
        Arc::new(Peer::new(&spec, Arc::default()))
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
