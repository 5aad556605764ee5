//! How a peer is chosen, and what a choice gave.
//!
//! `bounded_consistent_hash` walks clockwise from the key's point over distinct peers and takes
//! the first that is eligible and under its bound, the smaller of the peer's `max_in_flight`
//! and, when a balance factor `c` is set, `ceil(c · (in_flight + 1) · w_p / Σw)` over the
//! eligible peers (consistent hashing with bounded loads, weighted). `least_cost`, the
//! default, prices the first few peers of that walk by the seed's cost rule (see
//! [`super::cost`]) and takes the cheapest under the same bound, floored at what the engine
//! runs at once. Other policies share the same slots so that they can be compared on equal
//! terms.

use super::blocks::Blocks;
use super::cost::CostModel;
use super::peer::{Slot, UNLIMITED};
use super::pool::ModelId;
use super::queue::{Attempt, Outcome};

pub const DEFAULT_BALANCE_FACTOR: f64 = 1.25;

/// What `least_cost` never bounds a peer below while its engine's running slots are unknown:
/// fewer than any real engine runs at once (vLLM and SGLang run hundreds), so the floor keeps
/// a key's first concurrent requests together without ever queueing them at the engine.
pub const UNKNOWN_CAPACITY_FLOOR: u32 = 4;

/// The floor of a conversation's own home instead, while its engine's slots are unknown: a
/// turn sent on from its history prefills it again, so it stays until more run there than
/// any engine surely runs at once. New conversations keep the lower floor.
pub const CONVERSATION_FLOOR: u32 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Weighted rotation; skips peers at `max_in_flight`.
    RoundRobin,
    /// The peer with the fewest requests per unit of weight, under `max_in_flight`.
    LeastInFlight,
    /// Pure sticky hashing: the key's peer, however loaded.
    ConsistentHash,
    /// Sticky hashing that overflows clockwise past peers at their bound.
    BoundedConsistentHash,
    /// The cheapest of the key's first peers by expected latency, under the bound.
    LeastCost,
}

impl Policy {
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round_robin",
            Policy::LeastInFlight => "least_in_flight",
            Policy::ConsistentHash => "consistent_hash",
            Policy::BoundedConsistentHash => "bounded_consistent_hash",
            Policy::LeastCost => "least_cost",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Balance {
    pub policy: Policy,
    /// The `c` of the `(1+ε)` bound; `None` leaves only `max_in_flight`.
    pub balance_factor: Option<f64>,
    /// How `least_cost` prices a peer.
    pub cost: CostModel,
}

impl Default for Balance {
    fn default() -> Self {
        Self {
            policy: Policy::LeastCost,
            balance_factor: Some(DEFAULT_BALANCE_FACTOR),
            cost: CostModel::default(),
        }
    }
}

/// What a request asks of the cluster: its key's point on the ring, if it has a key, the size
/// of its prompt, and the prompt's block chain (how much of it each peer holds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Demand {
    pub hash: Option<u64>,
    pub prompt_tokens: u32,
    pub blocks: Blocks,
    /// The pool it goes to; `None`: any peer.
    pub model: Option<ModelId>,
}

/// Characters of text per token: OpenAI's rule of thumb for English, near enough for pricing.
pub const CHARS_PER_TOKEN: usize = 4;

impl From<Option<u64>> for Demand {
    /// A request with no prompt to price, known by its key alone.
    fn from(hash: Option<u64>) -> Self {
        Self {
            hash,
            prompt_tokens: 0,
            blocks: hash.map(Blocks::of_key).unwrap_or_default(),
            model: None,
        }
    }
}

/// What the bound of one peer is computed from.
#[derive(Debug, Clone, Copy)]
pub struct BoundInputs {
    pub max_in_flight: u32,
    pub weight: u32,
    /// Requests in flight across the cluster.
    pub total_in_flight: u64,
    /// Σ weight over the peers the walk may choose.
    pub eligible_weight: u64,
    /// Running slots the peer is known to have (0: unknown); `least_cost` never bounds a peer
    /// below them (or [`UNKNOWN_CAPACITY_FLOOR`]), since a free running slot costs no wait.
    pub capacity: u32,
    /// Whether the request is a turn of a conversation whose history this peer alone holds
    /// (then [`CONVERSATION_FLOOR`] is the floor while the slots are unknown).
    pub conversation_home: bool,
}

impl Balance {
    /// The in-flight ceiling of a peer: none for pure sticky hashing, `max_in_flight` for
    /// round robin and least in flight, and the smaller of that and the balance bound for
    /// bounded consistent hashing and least cost (which floors the balance bound at the peer's
    /// running slots).
    pub fn bound(&self, at: BoundInputs) -> u32 {
        let floor = match self.policy {
            Policy::ConsistentHash => return UNLIMITED,
            Policy::RoundRobin | Policy::LeastInFlight => return at.max_in_flight,
            Policy::BoundedConsistentHash => 0,
            Policy::LeastCost if at.capacity == 0 && at.conversation_home => CONVERSATION_FLOOR,
            Policy::LeastCost if at.capacity == 0 => UNKNOWN_CAPACITY_FLOOR,
            Policy::LeastCost => at.capacity,
        };
        let Some(c) = self.balance_factor else {
            return at.max_in_flight;
        };
        let total_weight = at.eligible_weight.max(1) as f64;
        let share = c * (at.total_in_flight as f64 + 1.0) * f64::from(at.weight) / total_weight;
        // c ≥ 1 and in_flight + 1 ≥ 1 keep the share positive, so every bound is at least 1.
        let share = share.ceil().min(f64::from(UNLIMITED)) as u32;
        at.max_in_flight.min(share.max(floor))
    }
}

/// How the chosen peer relates to the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// The key's own peer: the first eligible one on its walk.
    Primary,
    /// A later peer on the walk, because the ones before it were at their bound (or, under
    /// `least_cost`, dearer).
    Overflow,
    /// A later peer on the walk that recently served the key: a warm replica of its prefix.
    Replica,
    /// Chosen by load alone (round robin, least in flight, or a request with no key).
    Balanced,
}

impl Route {
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Primary => "primary",
            Route::Overflow => "overflow",
            Route::Replica => "replica",
            Route::Balanced => "balanced",
        }
    }
}

#[derive(Debug)]
pub struct Routed {
    pub slot: Slot,
    pub route: Route,
    /// Distinct peers looked at, the chosen one included.
    pub steps: u32,
}

#[derive(Debug)]
pub enum Decision {
    Routed(Routed),
    /// Eligible peers exist but every one is at its bound.
    Saturated,
    /// No peer is eligible (none configured, all down, draining or excluded).
    NoPeer,
}

impl Decision {
    pub fn routed(self) -> Option<Routed> {
        match self {
            Decision::Routed(r) => Some(r),
            _ => None,
        }
    }
}

impl Attempt for Decision {
    type Taken = Routed;

    fn outcome(self) -> Outcome<Routed> {
        match self {
            Decision::Routed(r) => Outcome::Taken(r),
            Decision::Saturated => Outcome::Busy,
            Decision::NoPeer => Outcome::Hopeless,
        }
    }
}
