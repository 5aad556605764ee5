//! The live routing state shared by the proxy, the admin listener and the control plane: the
//! current cluster (swapped whole on a membership change) and the settings that do not change
//! while the process runs.

use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::config::{Config, ConfigError, UpstreamConfig};
use crate::proxy::peek::PeekLimits;
use crate::routing::{
    Balance, Cluster, ClusterLoad, KeyExtractor, OutlierPolicy, PeerLoad, PeerSpec, QueueLimit,
    RingConfig,
};

pub struct Router {
    cluster: ArcSwap<Cluster>,
    /// Serialises membership changes: each rebuild must start from the cluster the last one
    /// stored.
    membership: Mutex<()>,
    load: Arc<ClusterLoad>,
    pub keys: KeyExtractor,
    pub balance: Balance,
    pub ring: RingConfig,
    pub queue: QueueLimit,
    pub peek: PeekLimits,
    pub upstream: UpstreamConfig,
    pub outlier: OutlierPolicy,
}

impl Router {
    pub fn from_config(config: &Config) -> Result<Self, ConfigError> {
        let ring = config.ring();
        let cluster = Cluster::new(&config.peer_specs()?, ring);
        Ok(Self {
            load: Arc::clone(cluster.load()),
            cluster: ArcSwap::from_pointee(cluster),
            membership: Mutex::new(()),
            keys: KeyExtractor::new(config.key_config()),
            balance: config.balance(),
            ring,
            queue: QueueLimit {
                max_waiting: config.queue.max_waiting,
                timeout: config.queue.timeout(),
            },
            peek: PeekLimits {
                peek_limit: config.routing.peek_limit_bytes,
                max_body: config.limits.max_body_bytes,
            },
            upstream: config.upstream.clone(),
            outlier: config.outlier(),
        })
    }

    /// The cluster as it is now. Hold it only for one decision: a swap may replace it.
    pub fn cluster(&self) -> arc_swap::Guard<Arc<Cluster>> {
        self.cluster.load()
    }

    /// Load shared by every cluster this router has had.
    pub fn load(&self) -> &Arc<ClusterLoad> {
        &self.load
    }

    /// Counts a failed request (connect error or 5xx) against `peer`, ejecting it when it
    /// keeps failing.
    pub fn peer_failed(&self, peer: &PeerLoad) {
        if let Some(backoff) = peer.record_failure(&self.outlier) {
            crate::metrics::PEER_EJECTIONS
                .with_label_values(&[peer.id()])
                .inc();
            log::warn!(
                "ejecting peer {} for {backoff:?}: repeated failures",
                peer.id()
            );
            self.cluster().refresh();
        }
    }

    /// Replaces the peers: survivors keep their counts, health and drain state; removed peers
    /// take no new requests and finish the ones they have.
    pub fn set_peers(&self, specs: &[PeerSpec]) {
        let _one_at_a_time = self.membership.lock().unwrap_or_else(|p| p.into_inner());
        let previous = self.cluster.load_full();
        let next = previous.rebuild(specs, self.ring);
        for gone in previous
            .peers()
            .iter()
            .filter(|p| next.peer(p.id()).is_none())
        {
            crate::metrics::forget_peer(gone.id());
        }
        self.cluster.store(Arc::new(next));
        // New peers are capacity the waiting line may take.
        self.load.waiters().wake_front();
    }
}
