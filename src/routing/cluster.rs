//! The peers a router chooses from: one ring plus the live load of each peer on it, and the
//! choice itself ([`Cluster::select`]), which takes the chosen peer's slot in the same step.
//!
//! A cluster is immutable but for its atomics; a membership change builds a new one with
//! [`Cluster::rebuild`], which hands every surviving [`Peer`] to the new ring.

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Weak};

use pingora_load_balancing::Backend;

use super::load::ClusterLoad;
use super::peer::Peer;
use super::policy::balance::Balance;
use super::policy::decision::{Decision, Demand};
use super::policy::view::{Eligible, PoolLoad, View};
use super::pool::{ModelId, ModelNames, Pools};
use super::record::PrefixRecord;
use super::ring::{Ring, RingConfig};
use super::spec::{canonical, PeerSpec};

#[derive(Debug)]
pub struct Cluster {
    ring: Ring,
    /// `peers[i]` is the load of `ring.peers()[i]`.
    peers: Vec<Arc<Peer>>,
    /// Removed peers whose last requests are still running; a peer added back resumes them.
    retired: Vec<Weak<Peer>>,
    load: Arc<ClusterLoad>,
    /// Which peers served which prompt blocks lately; kept across rebuilds.
    record: Arc<PrefixRecord>,
    /// Model names as interned for every cluster of the router.
    names: Arc<ModelNames>,
    pools: Pools,
    eligible: Eligible,
    /// Peer indices repeated by weight and interleaved, for round robin.
    rotation: Vec<u32>,
    cursor: AtomicUsize,
}

impl Cluster {
    pub fn new(specs: &[PeerSpec], ring: RingConfig) -> Self {
        Self::with_record(specs, ring, PrefixRecord::default())
    }

    /// A cluster whose prompt record is `record` (its memory budget set).
    pub fn with_record(specs: &[PeerSpec], ring: RingConfig, record: PrefixRecord) -> Self {
        Self::assemble(
            specs,
            ring,
            Arc::default(),
            Arc::new(record),
            Arc::default(),
            HashMap::new(),
        )
    }

    /// A cluster over `specs` that keeps the load, health and drain state of every peer that
    /// stays, marks the others removed, and lets their counts drain through their slots.
    pub fn rebuild(&self, specs: &[PeerSpec], ring: RingConfig) -> Self {
        let mut known: HashMap<String, Arc<Peer>> = self
            .retired
            .iter()
            .filter_map(Weak::upgrade)
            .chain(self.peers.iter().cloned())
            .map(|p| (p.id().to_owned(), p))
            .collect();
        let next = Self::assemble(
            specs,
            ring,
            Arc::clone(&self.load),
            Arc::clone(&self.record),
            Arc::clone(&self.names),
            known.clone(),
        );
        for spec in specs {
            known.remove(&spec.addr.to_string());
        }
        let mut retired = Vec::with_capacity(known.len());
        for gone in known.into_values() {
            gone.set_removed(true);
            // What others carry on a peer no longer routed to bounds nothing, and nothing
            // would update it: left, it would hold the peer among the left-out for good.
            gone.clear_external();
            retired.push(Arc::downgrade(&gone));
        }
        let cluster = Self { retired, ..next };
        cluster.refresh();
        cluster
    }

    fn assemble(
        specs: &[PeerSpec],
        ring: RingConfig,
        load: Arc<ClusterLoad>,
        record: Arc<PrefixRecord>,
        names: Arc<ModelNames>,
        mut known: HashMap<String, Arc<Peer>>,
    ) -> Self {
        let specs = canonical(specs.to_vec());
        let peers: Vec<Arc<Peer>> = specs
            .iter()
            .map(|s| {
                let id = s.addr.to_string();
                match known.remove(&id) {
                    Some(p) => {
                        p.set_limits(s);
                        p.set_removed(false);
                        p
                    }
                    None => Arc::new(Peer::new(s, Arc::clone(&load))),
                }
            })
            .collect();
        for (peer, spec) in peers.iter().zip(&specs) {
            peer.set_models(spec.models.as_ref(), &names);
        }
        let pools = Pools::new(&names, specs.iter().map(|s| s.models.clone()));
        let backends = specs
            .iter()
            .map(|s| Backend {
                addr: pingora::protocols::l4::socket::SocketAddr::Inet(s.addr),
                weight: s.weight.get() as usize,
                ext: Default::default(),
            })
            .collect();
        let max_weight = specs.iter().map(|s| s.weight.get()).max().unwrap_or(0);
        let rotation = (0..max_weight)
            .flat_map(|round| {
                specs
                    .iter()
                    .enumerate()
                    .filter(move |(_, s)| s.weight.get() > round)
                    .map(|(i, _)| i as u32)
            })
            .collect();
        let cluster = Self {
            ring: Ring::new(backends, ring),
            peers,
            retired: Vec::new(),
            load,
            record,
            names,
            pools,
            eligible: Eligible::default(),
            rotation,
            cursor: AtomicUsize::new(0),
        };
        cluster.refresh();
        cluster
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    pub fn record(&self) -> &PrefixRecord {
        &self.record
    }

    pub fn peers(&self) -> &[Arc<Peer>] {
        &self.peers
    }

    /// The models the peers list, and which pool a request for one goes to.
    pub fn pools(&self) -> &Pools {
        &self.pools
    }

    pub fn peer(&self, id: &str) -> Option<&Arc<Peer>> {
        self.peers.iter().find(|p| p.id() == id)
    }

    /// The load shared with every cluster rebuilt from this one.
    pub fn load(&self) -> &Arc<ClusterLoad> {
        &self.load
    }

    /// Requests in flight across all peers, removed ones included.
    pub fn in_flight(&self) -> u64 {
        self.load.in_flight()
    }

    /// Sets the load that others carry on each peer, by identity; peers it does not name carry
    /// none elsewhere.
    pub fn set_external(&self, external: impl Fn(&str) -> u32) {
        for p in &self.peers {
            p.set_external(external(p.id()));
        }
    }

    /// Σ weight over the peers the walk may choose: the denominator of the balance bound.
    pub fn eligible_weight(&self) -> u64 {
        self.eligible.weight()
    }

    /// Marks a peer up or down; false when it is not a member.
    pub fn set_healthy(&self, id: &str, healthy: bool) -> bool {
        self.update(id, |p| p.set_healthy(healthy))
    }

    pub fn set_draining(&self, id: &str, draining: bool) -> bool {
        self.update(id, |p| p.set_draining(draining))
    }

    fn update(&self, id: &str, f: impl FnOnce(&Peer)) -> bool {
        let Some(peer) = self.peer(id) else {
            return false;
        };
        f(peer);
        self.refresh();
        // A peer back up or undrained is capacity a waiter may take.
        self.load.waiters().wake_fronts();
        true
    }

    /// Sets every peer's health from `healthy`, given the peer's backend; wakes the waiting
    /// line when any came back.
    pub fn sync_health(&self, healthy: impl Fn(&Backend) -> bool) {
        for (peer, backend) in self.peers.iter().zip(self.ring.peers()) {
            peer.set_healthy(healthy(backend));
        }
        self.refresh();
        self.load.waiters().wake_fronts();
    }

    /// Recomputes the eligible weight and wakes the waiting line when it grew: an ejection that
    /// ran out is capacity nobody announced.
    pub fn refresh_and_wake(&self) {
        let before = self.eligible_weight();
        self.refresh();
        if self.eligible_weight() > before {
            self.load.waiters().wake_fronts();
        }
    }

    /// Recomputes the eligible weight and the peers left out of the bound, after a peer's
    /// eligibility changed (or ejections ran out).
    pub fn refresh(&self) {
        let w = self
            .peers
            .iter()
            .filter(|p| p.eligible())
            .map(|p| u64::from(p.weight()))
            .sum();
        // A peer came back (or joined): the keys that moved while it was out go home.
        if self.eligible.swap_weight(w) < w {
            self.record.forget();
        }
        let left_out = self
            .peers
            .iter()
            .filter(|p| !p.eligible())
            .cloned()
            .chain(self.retired.iter().filter_map(Weak::upgrade))
            .filter(|p| p.load() > 0)
            .collect();
        self.eligible.set_left_out(left_out);
    }

    /// Chooses a peer for a request (without a key: spread by load), skipping the peers in
    /// `excluded` (those that already failed this request), and takes its slot.
    pub fn select(
        &self,
        balance: &Balance,
        demand: impl Into<Demand>,
        excluded: &[Arc<Peer>],
    ) -> Decision {
        let demand = demand.into();
        super::policy::select(balance, &self.view(excluded, demand.model), &demand)
    }

    /// Chooses a peer for a request too light to be bounded (a model list, a health probe): the
    /// first eligible one on the key's walk, or on a walk from a point of its own without a
    /// key, whatever its load. Its slot is counted like any other, but no bound or
    /// `max_in_flight` refuses it, so it never waits in line behind the prompts.
    pub fn select_unbounded(&self, hash: Option<u64>, excluded: &[Arc<Peer>]) -> Decision {
        super::policy::unbounded(&self.view(excluded, None), hash)
    }

    /// The in-flight ceiling of `peer` under `balance`, in this cluster as it is now. Its mean
    /// is over the eligible peers: their load over their weight.
    pub fn bound(&self, balance: &Balance, peer: &Peer) -> u32 {
        self.view(&[], None).bound(balance, peer)
    }

    /// What a policy sees of the cluster for a request for `model` that `excluded` failed.
    fn view<'a>(&'a self, excluded: &'a [Arc<Peer>], model: Option<ModelId>) -> View<'a> {
        View {
            peers: &self.peers,
            ring: &self.ring,
            record: &self.record,
            rotation: &self.rotation,
            cursor: &self.cursor,
            load: &self.load,
            eligible: &self.eligible,
            // Within a pool, the bound's mean is the pool's own.
            pool: model.map(|m| PoolLoad::of(&self.peers, m)),
            model,
            excluded,
        }
    }
}
