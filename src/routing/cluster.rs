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

use super::cost::{Pricing, MAX_CANDIDATES, WARM_HIT};
use super::peer::{canonical, ClusterLoad, Peer, PeerSpec, Slot};
use super::policy::{Balance, BoundInputs, Decision, Demand, Policy, Route, Routed};
use super::pool::{ModelId, ModelNames, Pools};
use super::record::PrefixRecord;
use super::ring::{Ring, RingConfig};

/// How much cheaper than the primary another peer must be to take a request from it: less is
/// the noise of learned times and of tiny prompts, and moving a key for it costs a prefill.
pub const SPILL_MARGIN_MS: u64 = 5;

/// The share of home's cost another peer must also undercut it by: a move is priced to the
/// block (1 KiB) and trades decode time and home's other streams for the mover's own first
/// token, which it pays at once.
pub const SPILL_SHARE: f64 = 0.25;

/// The turns a new conversation is expected to send after this one.
const FUTURE_TURNS: f64 = 3.0;

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
            self.record.forget();
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
        let usable = usable(excluded, demand.model);
        // Within a pool, the bound's mean is the pool's own.
        let scope = demand.model.map(|m| self.pool_load(m));
        match (balance.policy, demand.hash) {
            (Policy::ConsistentHash, Some(h)) => {
                self.walk_select(self.ring.walk(h), 0, usable, |p| Some(p.take()))
            }
            (Policy::BoundedConsistentHash, Some(h)) => {
                let bounded = |p: &Arc<Peer>| p.try_take(self.bound_in(balance, p, scope));
                self.walk_select(self.ring.walk(h), 0, usable, bounded)
            }
            (Policy::LeastCost, Some(h)) => self.least_cost(balance, h, demand, scope, usable),
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
        match self.walk_select(self.ring.walk(point), 0, usable(excluded, None), take) {
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
        self.bound_in(balance, peer, None)
    }

    /// What the eligible peers serving `model` carry, and their weight: the bound's mean in
    /// that pool.
    fn pool_load(&self, model: ModelId) -> PoolLoad {
        let mut pool = PoolLoad::default();
        for p in self
            .peers
            .iter()
            .filter(|p| p.eligible() && p.serves(model))
        {
            pool.in_flight += u64::from(p.load());
            pool.weight += u64::from(p.weight());
        }
        pool
    }

    /// [`Self::bound`] with the mean over a pool's peers, when `pool` is given.
    fn bound_in(&self, balance: &Balance, peer: &Peer, pool: Option<PoolLoad>) -> u32 {
        balance.bound(self.bound_inputs(peer, pool))
    }

    fn bound_inputs(&self, peer: &Peer, pool: Option<PoolLoad>) -> BoundInputs {
        let (total_in_flight, eligible_weight) = match pool {
            Some(pool) => (pool.in_flight, pool.weight),
            None => {
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
                (total.saturating_sub(left_out), self.eligible_weight())
            }
        };
        BoundInputs {
            max_in_flight: peer.max_in_flight(),
            weight: peer.weight(),
            total_in_flight,
            eligible_weight,
            capacity: peer.capacity(),
            conversation_home: false,
        }
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

    /// Prices the first usable peers of the key's walk and the peers that hold part of the
    /// prompt lately (and, for a new conversation on a shared prefix, the least loaded peer,
    /// with the conversation's turns to come), and takes the cheapest one under its bound;
    /// when all of those are at theirs, the first peer further on with room. Another peer wins
    /// over the prompt's home (its primary, or the peer holding most of it once the record has
    /// seen its conversation) only by more than [`SPILL_MARGIN_MS`] (and, from a
    /// conversation's own home, [`SPILL_SHARE`] of home's cost), and ties go to home, then to
    /// the earlier peer of the walk, so that processes that see the same loads choose alike and
    /// noise does not move keys.
    fn least_cost(
        &self,
        balance: &Balance,
        hash: u64,
        demand: Demand,
        scope: Option<PoolLoad>,
        usable: impl Fn(&Arc<Peer>) -> bool,
    ) -> Decision {
        let prompt_tokens = demand.prompt_tokens;
        let want = balance.cost.candidates.clamp(1, MAX_CANDIDATES) as usize;
        let held = self.record.holdings(&demand.blocks);
        let alone = balance.cost.shared_prefix_placement;
        // The primary holds a conversation the record has not seen by construction: another
        // process may have sent it there, and no peer holding only its system prompt is priced
        // above it. With shared-prefix placement, the only process knows better: a
        // conversation new to it is new, and goes where its system prompt went. So does an
        // opening, new to every process: no peer holds more of it than its shared part. A key
        // of which nothing is held anywhere goes to its primary, where every process looks.
        let by_construction =
            !held.knows_key() && (held.is_empty() || (!alone && !demand.blocks.is_opening()));
        let cold = held.is_empty() && !demand.blocks.key_only();
        let hit_of = |first: bool, peer: &Peer| {
            let share = held.share(peer.serial());
            match (by_construction, first) {
                (true, true) => share.max(WARM_HIT),
                (true, false) => share.min(WARM_HIT),
                (false, _) => share,
            }
        };
        // A new conversation on a shared prefix settles where it goes: its turns to come are
        // priced there too, each the size of what this one adds to the shared part, and the
        // least loaded peer is priced beside the holders. A cold peer then wins one when the
        // warm ones are busy enough that the prefix's prefill pays for itself.
        let new_conversation = !held.is_empty() && (!held.knows_key() || held.deepest_is_shared());
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
        // The peers that hold part of the prompt are priced wherever they are on the walk: a
        // conversation that moved may have moved past its first peers.
        if !held.is_empty() {
            let mut idlest: Option<usize> = None;
            for (idx, peer) in self.peers.iter().enumerate() {
                if !usable(peer) || candidates[..n].contains(&idx) {
                    continue;
                }
                if n < candidates.len() && held.holds(peer.serial()) {
                    candidates[n] = idx;
                    n += 1;
                } else if idlest.is_none_or(|i| peer.load() < self.peers[i].load()) {
                    idlest = Some(idx);
                }
            }
            // Not a candidate when it was looked at, and only holders were added since.
            if let Some(idx) = idlest.filter(|_| new_conversation && n < candidates.len()) {
                candidates[n] = idx;
                n += 1;
            }
        }
        let mut hits = [0.0; MAX_CANDIDATES as usize];
        for (place, &idx) in candidates[..n].iter().enumerate() {
            hits[place] = hit_of(place == 0, &self.peers[idx]);
        }
        // Where the prompt is at home: the peer holding most of it once the record has seen
        // this conversation (its newest turns are there), else its primary. Another peer must
        // beat home by the margin, so that noise moves neither.
        let holds_most = (0..n).fold(0, |best, p| if hits[p] > hits[best] { p } else { best });
        let home = if by_construction { 0 } else { holds_most };
        let turn_tokens = if new_conversation {
            balance.cost.uncached(prompt_tokens, hits[holds_most]) as u32
        } else {
            0
        };
        // (cost in whole milliseconds, ring index, place among the priced, share held). Costs
        // are compared to the millisecond: finer differences are noise of each process's
        // learned stream times, and would break ties that processes should break alike.
        let mut priced = [(0u64, 0, 0, 0.0); MAX_CANDIDATES as usize];
        for (place, &idx) in candidates[..n].iter().enumerate() {
            let peer = &self.peers[idx];
            let hit = hits[place];
            let mut cost = balance.cost.estimate(&peer.pricing(hit), prompt_tokens);
            if new_conversation {
                // Later turns come after the prefill queued there now has drained.
                let later = Pricing {
                    prefill_queue: 0,
                    ..peer.pricing(0.0)
                };
                cost += FUTURE_TURNS * balance.cost.estimate(&later, turn_tokens);
            }
            priced[place] = ((cost * 1000.0).round() as u64, idx, place, hit);
        }
        // A conversation's own turns leave its history only for a clear gain; a new one
        // leaves home for any.
        let conversation = held.conversation_home();
        let margin = match conversation {
            Some(_) => SPILL_MARGIN_MS.max((priced[home].0 as f64 * SPILL_SHARE) as u64),
            None => SPILL_MARGIN_MS,
        };
        for p in priced[..n].iter_mut().filter(|p| p.2 != home) {
            p.0 += margin;
        }
        let priced = &mut priced[..n];
        priced.sort_unstable_by_key(|&(cost, _, place, _)| (cost, place != home, place));
        let record = |peer: &Peer, moved: bool| {
            // A key without its prompt that stays home, as most do, is left out: what the
            // record would say of it, the ring says already.
            if moved || !held.is_empty() || !demand.blocks.key_only() {
                self.record.record(&demand.blocks, peer.serial());
            }
        };
        for &(_, idx, place, hit) in priced.iter() {
            let peer = &self.peers[idx];
            let bound = balance.bound(BoundInputs {
                conversation_home: conversation == Some(peer.serial()),
                ..self.bound_inputs(peer, scope)
            });
            let Some(mut slot) = peer.try_take(bound) else {
                continue;
            };
            // Nobody holds a prompt the record has never seen served: the primary's share is
            // assumed for the choice (another process may have warmed it), but the prefill it
            // queues there is expected whole, so that the next requests for the prompt do not
            // wait behind it as if it were a turn.
            let expected = if cold { 0.0 } else { hit };
            slot.expect_prefill(balance.cost.uncached(prompt_tokens, expected));
            let route = match place {
                0 => Route::Primary,
                _ if hit > 0.0 => Route::Replica,
                _ => Route::Overflow,
            };
            record(peer, place > 0);
            return Decision::Routed(Routed { slot, route, steps });
        }
        let take = |p: &Arc<Peer>| {
            let mut slot = p.try_take(self.bound_in(balance, p, scope))?;
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

/// Whether the walk may choose a peer: eligible, serving the model asked for, and not one
/// that already failed this request.
fn usable(excluded: &[Arc<Peer>], model: Option<ModelId>) -> impl Fn(&Arc<Peer>) -> bool + '_ {
    move |p| {
        p.eligible()
            && model.is_none_or(|m| p.serves(m))
            && !excluded.iter().any(|e| Arc::ptr_eq(e, p))
    }
}

/// A pool's load and weight, as its bound reads them.
#[derive(Debug, Clone, Copy, Default)]
struct PoolLoad {
    in_flight: u64,
    weight: u64,
}
