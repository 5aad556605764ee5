//! What a request asks of the cluster, and what a choice gave.

use crate::routing::blocks::Blocks;
use crate::routing::pool::ModelId;
use crate::routing::queue::{Attempt, Outcome};
use crate::routing::slot::Slot;

/// What a request asks of the cluster: its key's point on the ring, if it has a key, the size
/// of its prompt, and the prompt's block chain (how much of it each peer holds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Demand {
    pub hash: Option<u64>,
    pub prompt_tokens: u32,
    pub blocks: Blocks,
    /// The pool it goes to; `None`: any peer.
    pub model: Option<ModelId>,
    /// Whether `hash` names a session (a header), not the prompt.
    pub session: bool,
}

impl From<Option<u64>> for Demand {
    /// A request with no prompt to price, known by its key alone.
    #[inline]
    fn from(hash: Option<u64>) -> Self {
        // Named in place, by functions marked `#[inline]`: a chain is some 800 bytes, and one
        // built apart (or by calls inlined only across codegen units, after the copies are
        // merged) was zeroed in a temporary and copied on every decision.
        let mut demand = Self {
            hash,
            prompt_tokens: 0,
            blocks: Blocks::default(),
            model: None,
            session: false,
        };
        if let Some(hash) = hash {
            demand.blocks.name_key(hash);
        }
        demand
    }
}

impl Demand {
    /// The same request priced by its key alone, as if its body named no prompt: the peer
    /// that served its key last holds all but its newest turn.
    pub fn by_key_alone(&mut self) {
        self.blocks = self.hash.map(Blocks::of_key).unwrap_or_default();
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
    /// The peer that holds the stored response the request continues, whatever its load.
    Affinity,
}

impl Route {
    pub const ALL: [Route; 5] = [
        Route::Primary,
        Route::Overflow,
        Route::Replica,
        Route::Balanced,
        Route::Affinity,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Route::Primary => "primary",
            Route::Overflow => "overflow",
            Route::Replica => "replica",
            Route::Balanced => "balanced",
            Route::Affinity => "affinity",
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
