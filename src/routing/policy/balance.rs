//! Which policy chooses, and the bound every bounded one shares: the smaller of a peer's
//! `max_in_flight` and, when a balance factor `c` is set, `ceil(c · (in_flight + 1) · w_p / Σw)`
//! over the eligible peers (consistent hashing with bounded loads, weighted).

use crate::routing::cost::CostModel;
use crate::routing::spec::UNLIMITED;

pub const DEFAULT_BALANCE_FACTOR: f64 = 1.25;

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
    /// How `least_cost` prices a peer, and the tuned figures of its rule.
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
    /// below them (or the tuning's `unknown_capacity_floor`), since a free running slot costs
    /// no wait.
    pub capacity: u32,
    /// Whether the peer is the request's home: it alone holds the conversation's history, or
    /// it holds more of the prompt than the tuning's `prefix_home_share` and as much as any
    /// peer (then the floor is the slots, or the tuning's `conversation_floor` while they are
    /// unknown, and its `conversation_queue` share of them more; at least
    /// `conversation_floor`).
    pub home: bool,
}

impl Balance {
    /// The in-flight ceiling of a peer: none for pure sticky hashing, `max_in_flight` for
    /// round robin and least in flight, and the smaller of that and the balance bound for
    /// bounded consistent hashing and least cost (which floors the balance bound at the peer's
    /// running slots).
    pub fn bound(&self, at: BoundInputs) -> u32 {
        let tuning = &self.cost.tuning;
        let floor = match self.policy {
            Policy::ConsistentHash => return UNLIMITED,
            Policy::RoundRobin | Policy::LeastInFlight => return at.max_in_flight,
            Policy::BoundedConsistentHash => 0,
            // A request sent from its home prefills its history (or its document) again
            // elsewhere, which costs more than waiting for one of home's slots while few wait
            // for them; the cost rule prices that wait, so home may queue some beyond them.
            // Until the engine shows its slots the conversation floor stands in for them, with
            // the same queue beyond: held at the floor alone, home never queues, and so never
            // shows them.
            Policy::LeastCost if at.home => {
                let slots = match at.capacity {
                    0 => tuning.conversation_floor,
                    known => known,
                };
                let queue = (f64::from(slots) * tuning.conversation_queue).ceil();
                let queue = queue.min(f64::from(UNLIMITED)) as u32;
                slots.saturating_add(queue).max(tuning.conversation_floor)
            }
            Policy::LeastCost if at.capacity == 0 => tuning.unknown_capacity_floor,
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
