//! The peers a router chooses from: one ring plus the live load of each peer on it, and the
//! choice itself ([`Cluster::select`]), which takes the chosen peer's slot in the same step.
//!
//! A cluster is immutable but for its atomics; a membership change builds a new one with
//! [`Cluster::rebuild`], which hands every surviving [`Peer`] to the new ring.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use arc_swap::ArcSwap;

use pingora_load_balancing::Backend;

use super::cost::{EARLIER_HIT, MAX_CANDIDATES, WARM_HIT};
use super::peer::{canonical, ClusterLoad, Peer, PeerSpec, Slot};
use super::policy::{Balance, BoundInputs, Decision, Demand, Policy, Route, Routed};
use super::ring::{Ring, RingConfig};
use super::warm::{Held, WarmReplicas};

/// How much cheaper than the primary another peer must be to take a request from it: less is
/// the noise of learned times and of tiny prompts, and moving a key for it costs a prefill.
pub const SPILL_MARGIN_MS: u64 = 5;

#[derive(Debug)]
pub struct Cluster {
    ring: Ring,
    /// `peers[i]` is the load of `ring.peers()[i]`.
    peers: Vec<Arc<Peer>>,
    /// Removed peers whose last requests are still running; a peer added back resumes them.
    retired: Vec<Weak<Peer>>,
    load: Arc<ClusterLoad>,
    /// Which peers served a key, or a key's shared part, lately; kept across rebuilds.
    warm: Arc<WarmReplicas>,
    eligible_weight: AtomicU64,
    /// Peers that carry requests but take no new ones (draining, down, ejected, removed): the
    /// bound leaves their load out, as it leaves their weight out.
    ineligible: ArcSwap<Vec<Arc<Peer>>>,
    /// Whether `ineligible` is not empty: the common case reads no more than this.
    any_ineligible: AtomicBool,
    /// Peer indices repeated by weight and interleaved, for round robin.
    rotation: Vec<u32>,
    cursor: AtomicUsize,
}

impl Cluster {
    pub fn new(specs: &[PeerSpec], ring: RingConfig) -> Self {
        Self::assemble(specs, ring, Arc::default(), Arc::default(), HashMap::new())
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
            Arc::clone(&self.warm),
            known.clone(),
        );
        for spec in specs {
            known.remove(&spec.addr.to_string());
        }
        let mut retired = Vec::with_capacity(known.len());
        for gone in known.into_values() {
            gone.set_removed(true);
            // What others carry on a peer no longer routed to bounds nothing.
            gone.set_external(0);
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
        warm: Arc<WarmReplicas>,
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
            warm,
            eligible_weight: AtomicU64::new(0),
            ineligible: ArcSwap::default(),
            any_ineligible: AtomicBool::new(false),
            rotation,
            cursor: AtomicUsize::new(0),
        };
        cluster.refresh();
        cluster
    }

    pub fn ring(&self) -> &Ring {
        &self.ring
    }

    pub fn peers(&self) -> &[Arc<Peer>] {
        &self.peers
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
        self.eligible_weight.load(Ordering::Relaxed)
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

    /// Recomputes the eligible weight and wakes the waiting line when it grew: an ejection that
    /// ran out is capacity nobody announced.
    pub fn refresh_and_wake(&self) {
        let before = self.eligible_weight();
        self.refresh();
        if self.eligible_weight() > before {
            self.load.waiters().wake_front();
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
        if self.eligible_weight.swap(w, Ordering::Relaxed) < w {
            self.warm.forget();
        }
        let left_out: Vec<Arc<Peer>> = self
            .peers
            .iter()
            .filter(|p| !p.eligible())
            .cloned()
            .chain(self.retired.iter().filter_map(Weak::upgrade))
            .filter(|p| p.load() > 0)
            .collect();
        let any = !left_out.is_empty();
        if any || self.any_ineligible.load(Ordering::Relaxed) {
            self.ineligible.store(Arc::new(left_out));
        }
        self.any_ineligible.store(any, Ordering::Relaxed);
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
        let usable = usable(excluded);
        match (balance.policy, demand.hash) {
            (Policy::ConsistentHash, Some(h)) => {
                self.walk_select(self.ring.walk(h), 0, usable, |p| Some(p.take()))
            }
            (Policy::BoundedConsistentHash, Some(h)) => {
                let bounded = |p: &Arc<Peer>| p.try_take(self.bound(balance, p));
                self.walk_select(self.ring.walk(h), 0, usable, bounded)
            }
            (Policy::LeastCost, Some(h)) => self.least_cost(balance, h, demand, usable),
            (Policy::RoundRobin, _) => self.round_robin(usable),
            (Policy::LeastInFlight, _) | (_, None) => self.least_in_flight(usable),
        }
    }

    /// Chooses a peer for a request too light to be bounded (a model list, a health probe): the
    /// first eligible one on the key's walk, or on a walk from a point of its own without a
    /// key, whatever its load. Its slot is counted like any other, but no bound or
    /// `max_in_flight` refuses it, so it never waits in line behind the prompts.
    pub fn select_unbounded(&self, hash: Option<u64>, excluded: &[Arc<Peer>]) -> Decision {
        // Without a key, from a point of its own: Fibonacci hashing spreads consecutive counts
        // over the ring.
        let point = hash.unwrap_or_else(|| {
            (self.cursor.fetch_add(1, Ordering::Relaxed) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        });
        let take = |p: &Arc<Peer>| Some(p.take());
        match self.walk_select(self.ring.walk(point), 0, usable(excluded), take) {
            Decision::Routed(routed) if hash.is_none() => Decision::Routed(Routed {
                route: Route::Balanced,
                ..routed
            }),
            decision => decision,
        }
    }

    /// The in-flight ceiling of `peer` under `balance`, in this cluster as it is now. Its mean
    /// is over the eligible peers: their load over their weight. (Counting what a draining or
    /// ejected peer still carries would raise every other peer's ceiling by that much.)
    pub fn bound(&self, balance: &Balance, peer: &Peer) -> u32 {
        let left_out: u64 = if self.any_ineligible.load(Ordering::Relaxed) {
            self.ineligible
                .load()
                .iter()
                .map(|p| u64::from(p.load()))
                .sum()
        } else {
            0
        };
        let total = self.in_flight() + self.load.external();
        balance.bound(BoundInputs {
            max_in_flight: peer.max_in_flight(),
            weight: peer.weight(),
            total_in_flight: total.saturating_sub(left_out),
            eligible_weight: self.eligible_weight(),
            capacity: peer.capacity(),
        })
    }

    /// The first usable peer of `walk` that `take` gives a slot on; `seen` usable peers came
    /// before the walk (priced, and full).
    fn walk_select(
        &self,
        walk: impl Iterator<Item = usize>,
        seen: u32,
        usable: impl Fn(&Arc<Peer>) -> bool,
        take: impl Fn(&Arc<Peer>) -> Option<Slot>,
    ) -> Decision {
        let (mut steps, mut candidates) = (seen, seen);
        for idx in walk {
            steps += 1;
            let peer = &self.peers[idx];
            if !usable(peer) {
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

    /// Prices the first usable peers of the key's walk, the peers that served the key lately
    /// and, for a key it has not seen, those that served its shared prefix, and takes the
    /// cheapest one under its bound; when all of those are at theirs, the first peer further
    /// on with room. Another peer wins over the primary only by more than [`SPILL_MARGIN_MS`],
    /// and ties go to the earlier peer of the walk, so that processes that see the same loads
    /// choose alike and noise does not move keys.
    fn least_cost(
        &self,
        balance: &Balance,
        hash: u64,
        demand: Demand,
        usable: impl Fn(&Arc<Peer>) -> bool,
    ) -> Decision {
        let prompt_tokens = demand.prompt_tokens;
        let want = balance.cost.candidates.clamp(1, MAX_CANDIDATES) as usize;
        let holders = self.warm.holders(hash);
        // A conversation this process has not seen whose system prompt it has sent somewhere:
        // the peers it went to hold that share of this prompt.
        let shared = demand
            .shared
            .filter(|_| holders.is_empty())
            .map(|(h, tokens)| {
                let share = f64::from(tokens) / f64::from(prompt_tokens.max(1));
                (h, self.warm.holders(h), share.min(WARM_HIT))
            });
        let knows_shared = shared.is_some_and(|(_, held, _)| !held.is_empty());
        let alone = balance.cost.shared_prefix_placement;
        let hit_of = |first: bool, peer: &Peer| {
            let own = match holders.of(peer.serial()) {
                Held::Latest => WARM_HIT,
                Held::Earlier => EARLIER_HIT,
                // The primary holds the key by construction, until the record says it moved,
                // or, with shared-prefix placement, knows where its shared part went: a key
                // new to the only process is new. (Another may have sent it to its primary.)
                Held::No if first && holders.is_empty() && !(alone && knows_shared) => WARM_HIT,
                Held::No if first && !holders.is_empty() => EARLIER_HIT,
                Held::No => 0.0,
            };
            let via_shared = match shared {
                Some((_, held, share)) if held.of(peer.serial()) != Held::No => share,
                _ => 0.0,
            };
            f64::max(own, via_shared)
        };
        let mut candidates = [0usize; MAX_CANDIDATES as usize];
        let (mut n, mut steps) = (0, 0);
        let mut walk = self.ring.walk(hash);
        while n < want {
            let Some(idx) = walk.next() else { break };
            steps += 1;
            if usable(&self.peers[idx]) {
                candidates[n] = idx;
                n += 1;
            }
        }
        // The peers that hold the key, or its shared part, are priced wherever they are on
        // the walk: a key that moved may have moved past its first peers.
        let holds = |peer: &Peer| {
            holders.of(peer.serial()) != Held::No
                || shared.is_some_and(|(_, held, _)| held.of(peer.serial()) != Held::No)
        };
        if !holders.is_empty() || knows_shared {
            for (idx, peer) in self.peers.iter().enumerate() {
                if n < candidates.len()
                    && holds(peer)
                    && usable(peer)
                    && !candidates[..n].contains(&idx)
                {
                    candidates[n] = idx;
                    n += 1;
                }
            }
        }
        // (cost in whole milliseconds, ring index, place among the priced, share held). Costs
        // are compared to the millisecond: finer differences are noise of each process's
        // learned stream times, and would break ties that processes should break alike.
        let mut priced = [(0u64, 0, 0, 0.0); MAX_CANDIDATES as usize];
        for (place, &idx) in candidates[..n].iter().enumerate() {
            let peer = &self.peers[idx];
            let hit = hit_of(place == 0, peer);
            let cost = balance.cost.estimate(&peer.pricing(hit), prompt_tokens);
            let margin = if place == 0 { 0 } else { SPILL_MARGIN_MS };
            priced[place] = ((cost * 1000.0).round() as u64 + margin, idx, place, hit);
        }
        let priced = &mut priced[..n];
        priced.sort_unstable_by_key(|&(cost, _, place, _)| (cost, place));
        let record = |peer: &Peer, moved: bool| {
            // The primary too, once the key has moved or was placed by its shared part: it
            // may be where it returns.
            if moved || !holders.is_empty() || shared.is_some() {
                self.warm.record(hash, peer.serial());
            }
            if let Some((h, _, _)) = shared {
                self.warm.record(h, peer.serial());
            }
        };
        for &(_, idx, place, hit) in priced.iter() {
            let peer = &self.peers[idx];
            let Some(mut slot) = peer.try_take(self.bound(balance, peer)) else {
                continue;
            };
            slot.expect_prefill(balance.cost.uncached(prompt_tokens, hit));
            let route = match place {
                0 => Route::Primary,
                _ if hit > 0.0 => Route::Replica,
                _ => Route::Overflow,
            };
            record(peer, place > 0);
            return Decision::Routed(Routed { slot, route, steps });
        }
        let take = |p: &Arc<Peer>| {
            let mut slot = p.try_take(self.bound(balance, p))?;
            slot.expect_prefill(balance.cost.uncached(prompt_tokens, 0.0));
            record(p, true);
            Some(slot)
        };
        let seen = priced.len() as u32;
        match self.walk_select(walk, seen, usable, take) {
            Decision::Routed(r) => Decision::Routed(Routed {
                steps: steps + r.steps - seen,
                ..r
            }),
            other => other,
        }
    }

    fn round_robin(&self, usable: impl Fn(&Arc<Peer>) -> bool) -> Decision {
        let n = self.rotation.len();
        if n == 0 {
            return Decision::NoPeer;
        }
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        let mut candidates = 0;
        for i in 0..n {
            let peer = &self.peers[self.rotation[(start + i) % n] as usize];
            if !usable(peer) {
                continue;
            }
            candidates += 1;
            if let Some(slot) = peer.try_take(peer.max_in_flight()) {
                return Decision::Routed(Routed {
                    slot,
                    route: Route::Balanced,
                    steps: candidates,
                });
            }
        }
        if candidates == 0 {
            Decision::NoPeer
        } else {
            Decision::Saturated
        }
    }

    fn least_in_flight(&self, usable: impl Fn(&Arc<Peer>) -> bool) -> Decision {
        // A lost race for the least-loaded peer's last slot looks again; a few tries suffice,
        // since each lost race means another request made progress.
        for _ in 0..4 {
            let mut best: Option<&Arc<Peer>> = None;
            let mut any = false;
            for peer in self.peers.iter().filter(|p| usable(p)) {
                any = true;
                if peer.load() >= peer.max_in_flight() {
                    continue;
                }
                let lighter = best.is_none_or(|b| {
                    u64::from(peer.load()) * u64::from(b.weight())
                        < u64::from(b.load()) * u64::from(peer.weight())
                });
                if lighter {
                    best = Some(peer);
                }
            }
            let Some(peer) = best else {
                return if any {
                    Decision::Saturated
                } else {
                    Decision::NoPeer
                };
            };
            if let Some(slot) = peer.try_take(peer.max_in_flight()) {
                return Decision::Routed(Routed {
                    slot,
                    route: Route::Balanced,
                    steps: 1,
                });
            }
        }
        Decision::Saturated
    }
}

/// Whether the walk may choose a peer: eligible, and not one that already failed this request.
fn usable(excluded: &[Arc<Peer>]) -> impl Fn(&Arc<Peer>) -> bool + '_ {
    move |p| p.eligible() && !excluded.iter().any(|e| Arc::ptr_eq(e, p))
}
