//! The live routing state shared by the proxy, the admin listener and the control plane: the
//! current cluster (swapped whole on a membership change), how keys are read and how peers are
//! chosen. It reports what happened (an ejection, the peers that left) to its callers, which
//! log and count it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::routing::{
    canonical, Balance, Cluster, ClusterLoad, KeyExtractor, OutlierPolicy, Peer, PeerSpec,
    PrefixRecord, RingConfig,
};
use crate::settings::RouterSettings;

pub struct Router {
    cluster: ArcSwap<Cluster>,
    /// Serialises changes to the cluster: each rebuild must start from the cluster the last one
    /// stored, and a drain or a health change must land on the cluster that stays.
    membership: Mutex<Sources>,
    load: Arc<ClusterLoad>,
    pub keys: KeyExtractor,
    pub balance: Balance,
    ring: RingConfig,
    outlier: OutlierPolicy,
    /// Makes the count of peers out and the ejection it allows one step: two failures at once
    /// must not each see room for one more.
    ejecting: Mutex<()>,
}

/// Where the peers come from: the source's list, and the models peers that list none said
/// they serve.
struct Sources {
    listed: Vec<PeerSpec>,
    discovered: HashMap<SocketAddr, Vec<String>>,
}

impl Sources {
    fn merged(&self) -> Vec<PeerSpec> {
        self.listed
            .iter()
            .map(|s| PeerSpec {
                models: s
                    .models
                    .clone()
                    .or_else(|| self.discovered.get(&s.addr).cloned()),
                ..s.clone()
            })
            .collect()
    }
}

/// What a change of the peer list did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipChange {
    /// The peers now, in address order.
    pub peers: usize,
    /// Identities of the peers that left.
    pub removed: Vec<String>,
}

impl Router {
    pub fn new(settings: RouterSettings, peers: &[PeerSpec]) -> Self {
        // Every part reads its figures from the one tuning the cost model carries.
        let tuning = &settings.balance.cost.tuning;
        let record = PrefixRecord::with_bytes(settings.record_bytes).tuned(tuning);
        let cluster = Cluster::with_record(peers, settings.ring, record);
        Self {
            load: Arc::clone(cluster.load()),
            cluster: ArcSwap::from_pointee(cluster),
            membership: Mutex::new(Sources {
                listed: canonical(peers.to_vec()),
                discovered: HashMap::new(),
            }),
            keys: KeyExtractor::new(settings.keys).tuned(tuning),
            balance: settings.balance,
            ring: settings.ring,
            outlier: settings.outlier,
            ejecting: Mutex::new(()),
        }
    }

    /// The cluster as it is now. Hold it only for one decision: a swap may replace it.
    pub fn cluster(&self) -> arc_swap::Guard<Arc<Cluster>> {
        self.cluster.load()
    }

    /// Load shared by every cluster this router has had.
    pub fn load(&self) -> &Arc<ClusterLoad> {
        &self.load
    }

    /// Counts a failed request (connect error or gateway answer) against `peer`. Returns the ejection
    /// it caused, if it caused one.
    pub fn peer_failed(&self, peer: &Peer) -> Option<Duration> {
        let backoff = {
            let _one_at_a_time = self.ejecting.lock().unwrap_or_else(|p| p.into_inner());
            let cluster = self.cluster();
            // The share out is of the peers that would serve but for an ejection: counting
            // down or draining ones, which serve nothing, would let every serving one go.
            let (members, ejected) = cluster
                .peers()
                .iter()
                .filter(|p| p.healthy() && !p.draining())
                .fold((0, 0), |(m, e), p| (m + 1, e + usize::from(p.ejected())));
            let may_eject = self.outlier.may_eject(ejected, members);
            peer.record_failure(&self.outlier, may_eject)?
        };
        // On the request path: not behind a rebuild that holds the membership lock while it
        // places a ring's points. That rebuild counts the ejection in the cluster it stores if
        // it came first, and the control plane's tick (every reload interval) if not.
        let free = match self.membership.try_lock() {
            Ok(guard) => Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        if let Some(_one_at_a_time) = free {
            self.cluster().refresh();
        }
        Some(backoff)
    }

    /// The wait before its own prefill that the cost rule expects for a request sent to
    /// `peer` now (see [`crate::routing::cost`]).
    pub fn estimated_wait(&self, peer: &Peer) -> Duration {
        Duration::from_secs_f64(self.balance.cost.wait(&peer.pricing(0.0)))
    }

    /// Recomputes the current cluster's eligible weight after a peer's eligibility changed, in
    /// turn with membership changes (on the cluster a racing rebuild stored, not the one it
    /// replaced).
    pub fn refresh(&self) {
        let _one_at_a_time = self.membership.lock().unwrap_or_else(|p| p.into_inner());
        self.cluster().refresh();
    }

    /// [`Cluster::refresh_and_wake`] (ejections ran out), in turn with membership changes.
    pub fn refresh_and_wake(&self) {
        let _one_at_a_time = self.membership.lock().unwrap_or_else(|p| p.into_inner());
        self.cluster().refresh_and_wake();
    }

    /// Drains a peer or takes it back; false when it is not a member. In turn with membership
    /// changes, so that the eligible weight is recomputed on the cluster that stays.
    pub fn set_draining(&self, id: &str, draining: bool) -> bool {
        let _one_at_a_time = self.membership.lock().unwrap_or_else(|p| p.into_inner());
        self.cluster().set_draining(id, draining)
    }

    /// Sets each peer's health from `healthy`, in turn with membership changes.
    pub fn sync_health(&self, healthy: impl Fn(&pingora_load_balancing::Backend) -> bool) {
        let _one_at_a_time = self.membership.lock().unwrap_or_else(|p| p.into_inner());
        self.cluster().sync_health(healthy);
    }

    /// Replaces the peers: survivors keep their counts, health and drain state; removed peers
    /// take no new requests and finish the ones they have. `None` when the list is the one
    /// the router has already.
    pub fn set_peers(&self, specs: Vec<PeerSpec>) -> Option<MembershipChange> {
        let mut sources = self.membership.lock().unwrap_or_else(|p| p.into_inner());
        sources.listed = canonical(specs);
        // What peers gone from the list said goes with them.
        let Sources { listed, discovered } = &mut *sources;
        discovered.retain(|addr, _| listed.iter().any(|s| s.addr == *addr));
        self.rebuild(&sources)
    }

    /// The peers that list no models: the ones whose models are asked of them.
    pub fn unlisted_models(&self) -> Vec<SocketAddr> {
        let sources = self.membership.lock().unwrap_or_else(|p| p.into_inner());
        sources
            .listed
            .iter()
            .filter(|s| s.models.is_none())
            .map(|s| s.addr)
            .collect()
    }

    /// Takes the models a peer said it serves; rebuilds the cluster when they changed.
    pub fn set_discovered_models(&self, addr: SocketAddr, models: Vec<String>) -> bool {
        let mut sources = self.membership.lock().unwrap_or_else(|p| p.into_inner());
        if sources.discovered.get(&addr) == Some(&models) {
            return false;
        }
        sources.discovered.insert(addr, models);
        self.rebuild(&sources);
        true
    }

    fn rebuild(&self, sources: &Sources) -> Option<MembershipChange> {
        let specs = sources.merged();
        let previous = self.cluster.load_full();
        if previous
            .peers()
            .iter()
            .map(|p| p.spec())
            .eq(specs.iter().cloned())
        {
            return None;
        }
        let next = previous.rebuild(&specs, self.ring);
        let removed = previous
            .peers()
            .iter()
            .filter(|p| next.peer(p.id()).is_none())
            .map(|p| p.id().to_owned())
            .collect();
        self.cluster.store(Arc::new(next));
        // New peers are capacity the waiting line may take.
        self.load.waiters().wake_fronts();
        Some(MembershipChange {
            peers: specs.len(),
            removed,
        })
    }
}
