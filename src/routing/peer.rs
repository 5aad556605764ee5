//! The live peer: what it carries, what it may carry and whether it may be chosen (its slots,
//! each counting one request on it, are [`crate::routing::slot`]'s). A [`Peer`] is keyed by its
//! address and outlives any one ring: a rebuild hands the same `Arc` to the new ring, so a peer
//! that stays keeps its count, and a removed peer's count drains through the slots that still
//! hold it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;

use super::cost::Pricing;
use super::engine::{CacheReport, Engine, EngineReport};
use super::load::{ClusterLoad, Others};
use super::outlier::{Outlier, OutlierPolicy};
use super::pool::{serves, Listed, ModelId, ModelNames};
use super::prefill::RATES_APART;
use super::progress::{Change, Progress};
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
    pub(super) in_flight: AtomicU32,
    others: Others,
    pub(super) engine: Engine,
    /// Prompt tokens this process expects the peer still to prefill: its requests' uncached
    /// estimates, from the choice to the first byte of the answer.
    pub(super) prefill_queue: AtomicU64,
    healthy: AtomicBool,
    draining: AtomicBool,
    removed: AtomicBool,
    outlier: Outlier,
    progress: Progress,
    pub(super) cluster: Arc<ClusterLoad>,
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
            progress: Progress::default(),
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
    /// Whether its engine has carried requests and sent nothing for the wedge limit: it takes
    /// no new request, as if at its bound, until it sends again.
    pub fn wedged(&self) -> bool {
        self.progress.wedged()
    }
    /// Times it was found wedged.
    pub fn wedges(&self) -> u64 {
        self.progress.wedges()
    }
    /// A byte of an answer came from it.
    pub fn advanced(&self) {
        self.progress.advanced();
    }
    /// The sweep of [`Progress::check`], with this process's requests on it as the work owed.
    pub fn check_progress(&self, limit: Duration) -> Option<Change> {
        self.progress.check(self.in_flight() > 0, limit)
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

    /// Prompt tokens it prefills a second, as its answers showed; `None` until they have.
    pub fn prefill_rate(&self) -> Option<f64> {
        self.engine.prefill_rate()
    }

    /// Its engine's reported cached tokens against the record's prediction.
    pub fn cache_report(&self) -> CacheReport {
        self.engine.cache_report()
    }

    /// What the cost rule believes of the peer now, for a prompt it holds `hit` of.
    pub fn pricing(&self, hit: f64) -> Pricing {
        Pricing {
            load: self.load(),
            capacity: self.capacity(),
            prefill_queue: self.prefill_queue(),
            decode: self.decode_time(),
            rate: priced_rate(self.prefill_rate(), self.cluster.prefill_rate()),
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
    /// Forgets what others carry here: for a peer removed, which no scrape or sibling updates.
    pub(crate) fn clear_external(&self) {
        self.others.clear(&self.cluster);
    }

    pub(crate) fn set_external(&self, external: u32) {
        self.others.set_from_siblings(external, &self.cluster);
    }

    /// What the engine reported on its last scrape, `None` when that scrape failed: the
    /// requests it has beyond this process's own count as load carried by others, and its work
    /// done, which counts as progress as a byte of an answer does.
    pub fn set_engine(&self, figures: Option<EngineReport>) {
        let excess = figures.map_or(0, |f| {
            f.running
                .saturating_add(f.waiting)
                .saturating_sub(self.in_flight())
        });
        if self.engine.report(figures) {
            self.progress.advanced();
        }
        self.others.set_from_engine(excess, &self.cluster);
    }

    /// The engine's last figures and how old they are, if the last scrape gave any.
    pub fn engine(&self) -> Option<(EngineReport, Duration)> {
        self.engine.last()
    }
}

/// The rate a peer is priced at: the peers' own while its own is within [`RATES_APART`] of it
/// or unknown, its own beyond.
fn priced_rate(own: Option<f64>, peers: Option<f64>) -> Option<f64> {
    match (own, peers) {
        (Some(own), Some(peers)) if own > peers * RATES_APART || own * RATES_APART < peers => {
            Some(own)
        }
        (_, Some(peers)) => Some(peers),
        (own, None) => own,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_priced_at_its_own_rate_only_when_it_stands_apart() {
        assert_eq!(priced_rate(None, None), None);
        assert_eq!(priced_rate(Some(900.0), None), Some(900.0));
        assert_eq!(priced_rate(None, Some(1_000.0)), Some(1_000.0));
        assert_eq!(priced_rate(Some(1_200.0), Some(1_000.0)), Some(1_000.0));
        assert_eq!(priced_rate(Some(500.0), Some(1_000.0)), Some(500.0));
        assert_eq!(priced_rate(Some(2_000.0), Some(1_000.0)), Some(2_000.0));
    }

    #[test]
    fn an_ejected_peer_is_not_eligible() {
        let spec = PeerSpec::new("127.0.0.1:1".parse().unwrap()).max_in_flight(4);
        let p = Peer::new(&spec, Arc::default());
        let policy = OutlierPolicy {
            consecutive_failures: 1,
            ..OutlierPolicy::default()
        };
        assert!(p.eligible());
        assert!(p.record_failure(&policy, true).is_some());
        assert!(p.ejected() && !p.eligible());
    }
}
