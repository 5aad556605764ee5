//! The peers a router chooses from: one ring plus the live load of each peer on it.
//!
//! A cluster is immutable but for its atomics; a membership change builds a new one with
//! [`Cluster::rebuild`], which hands every surviving peer's [`PeerLoad`] to the new ring.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use pingora_load_balancing::Backend;

use super::ring::{Ring, RingConfig, MAX_WEIGHT};
use super::slots::{ClusterLoad, PeerLoad};

/// One peer as configured or discovered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    pub addr: SocketAddr,
    pub weight: u32,
    /// The fixed in-flight ceiling; [`super::slots::UNLIMITED`] for none.
    pub max_in_flight: u32,
}

#[derive(Debug)]
pub struct Cluster {
    ring: Ring,
    /// `peers[i]` is the load of `ring.peers()[i]`.
    peers: Vec<Arc<PeerLoad>>,
    /// Removed peers whose last requests are still running; a peer added back resumes them.
    retired: Vec<Weak<PeerLoad>>,
    load: Arc<ClusterLoad>,
    eligible_weight: AtomicU64,
    /// Peer indices repeated by weight and interleaved, for round robin.
    pub(super) rotation: Vec<u32>,
    pub(super) cursor: AtomicUsize,
}

impl Cluster {
    pub fn new(specs: &[PeerSpec], ring: RingConfig) -> Self {
        Self::assemble(specs, ring, Arc::default(), HashMap::new())
    }

    /// A cluster over `specs` that keeps the load, health and drain state of every peer that
    /// stays, marks the others removed, and lets their counts drain through their slots.
    pub fn rebuild(&self, specs: &[PeerSpec], ring: RingConfig) -> Self {
        let mut known: HashMap<String, Arc<PeerLoad>> = self
            .retired
            .iter()
            .filter_map(Weak::upgrade)
            .chain(self.peers.iter().cloned())
            .map(|p| (p.id().to_owned(), p))
            .collect();
        let next = Self::assemble(specs, ring, Arc::clone(&self.load), known.clone());
        for spec in specs {
            known.remove(&spec.addr.to_string());
        }
        let mut retired = Vec::with_capacity(known.len());
        for gone in known.into_values() {
            gone.set_removed(true);
            retired.push(Arc::downgrade(&gone));
        }
        Self { retired, ..next }
    }

    fn assemble(
        specs: &[PeerSpec],
        ring: RingConfig,
        load: Arc<ClusterLoad>,
        mut known: HashMap<String, Arc<PeerLoad>>,
    ) -> Self {
        let mut specs = specs.to_vec();
        for s in &mut specs {
            s.weight = s.weight.clamp(1, MAX_WEIGHT);
        }
        specs.sort_by_key(|s| s.addr);
        specs.dedup_by_key(|s| s.addr);
        let peers: Vec<Arc<PeerLoad>> = specs
            .iter()
            .map(|s| {
                let id = s.addr.to_string();
                match known.remove(&id) {
                    Some(p) => {
                        p.set_limits(s.weight, s.max_in_flight);
                        p.set_removed(false);
                        p
                    }
                    None => Arc::new(PeerLoad::new(
                        s.addr,
                        s.weight,
                        s.max_in_flight,
                        Arc::clone(&load),
                    )),
                }
            })
            .collect();
        let backends = specs
            .iter()
            .map(|s| Backend {
                addr: pingora::protocols::l4::socket::SocketAddr::Inet(s.addr),
                weight: s.weight.max(1) as usize,
                ext: Default::default(),
            })
            .collect();
        let max_weight = specs.iter().map(|s| s.weight.max(1)).max().unwrap_or(0);
        let rotation = (0..max_weight)
            .flat_map(|round| {
                specs
                    .iter()
                    .enumerate()
                    .filter(move |(_, s)| s.weight.max(1) > round)
                    .map(|(i, _)| i as u32)
            })
            .collect();
        let cluster = Self {
            ring: Ring::new(backends, ring),
            peers,
            retired: Vec::new(),
            load,
            eligible_weight: AtomicU64::new(0),
            rotation,
            cursor: AtomicUsize::new(0),
        };
        cluster.refresh();
        cluster
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    pub fn peers(&self) -> &[Arc<PeerLoad>] {
        &self.peers
    }

    pub fn peer(&self, id: &str) -> Option<&Arc<PeerLoad>> {
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

    /// Σ weight over the peers the walk may choose: the denominator of the balance bound.
    pub fn eligible_weight(&self) -> u64 {
        self.eligible_weight.load(Ordering::Relaxed)
    }

    /// Marks a peer up or down; false when it is not a member.
    pub fn set_healthy(&self, id: &str, healthy: bool) -> bool {
        self.update(id, |p| p.set_healthy(healthy))
    }

    pub fn set_draining(&self, id: &str, draining: bool) -> bool {
        self.update(id, |p| p.set_draining(draining))
    }

    fn update(&self, id: &str, f: impl FnOnce(&PeerLoad)) -> bool {
        let Some(peer) = self.peer(id) else {
            return false;
        };
        f(peer);
        self.refresh();
        // A peer back up or undrained is capacity a waiter may take.
        self.load.waiters().wake_front();
        true
    }

    /// Sets every peer's health from `healthy`, given the peer's backend; wakes the waiting
    /// line when any came back.
    pub fn sync_health(&self, healthy: impl Fn(&Backend) -> bool) {
        for (peer, backend) in self.peers.iter().zip(self.ring.peers()) {
            peer.set_healthy(healthy(backend));
        }
        self.refresh();
        self.load.waiters().wake_front();
    }

    /// Recomputes the eligible weight, after ejections began or ran out.
    pub fn refresh(&self) {
        let w = self
            .peers
            .iter()
            .filter(|p| p.eligible())
            .map(|p| u64::from(p.weight()))
            .sum();
        self.eligible_weight.store(w, Ordering::Relaxed);
    }
}
