//! The routing core: key extraction, hashing, the ring, bounded-load selection and in-flight
//! accounting. Nothing here touches a socket or a Pingora session, so every decision can be
//! tested and benchmarked on its own.
//!
//! One decision, from request to slot:
//!
//! ```
//! use http::{HeaderMap, Method};
//! use prefixlb::routing::*;
//!
//! let peers: Vec<PeerSpec> = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
//!     .iter()
//!     .map(|a| PeerSpec::new(a.parse().unwrap()).max_in_flight(8))
//!     .collect();
//! let cluster = Cluster::new(&peers, RingConfig::default());
//! let keys = KeyExtractor::default();
//!
//! let turn = |n: usize| {
//!     let mut messages = vec![
//!         r#"{"role":"system","content":"You are a triage assistant."}"#.to_owned(),
//!         r#"{"role":"user","content":"Patient, 54, chest pain."}"#.to_owned(),
//!     ];
//!     for i in 1..n {
//!         messages.push(format!(r#"{{"role":"assistant","content":"answer {i}"}}"#));
//!         messages.push(format!(r#"{{"role":"user","content":"question {i}"}}"#));
//!     }
//!     format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","))
//! };
//! let key_of = |body: &str| match keys.key_for(&RequestParts {
//!     method: &Method::POST,
//!     path: "/v1/chat/completions",
//!     headers: &HeaderMap::new(),
//!     client: None,
//!     body: body.as_bytes(),
//!     end: BodyEnd::Complete,
//! }) {
//!     Extract::Key(key) => key,
//!     _ => unreachable!("a complete body needs no more"),
//! };
//!
//! // Turn 1 and turn 5 of the conversation share a key, hence a peer.
//! let (first, fifth) = (key_of(&turn(1)), key_of(&turn(5)));
//! assert_eq!(first.hash, fifth.hash);
//! assert_eq!(first.source, KeySource::Chat);
//!
//! let routed = cluster.select(&Balance::default(), first.hash, &[]).routed().unwrap();
//! assert_eq!(routed.route, Route::Primary);
//! assert_eq!(routed.slot.peer().in_flight(), 1);
//! drop(routed); // the slot is released exactly once, here
//! assert_eq!(cluster.in_flight(), 0);
//! ```

//! The modules, bottom up (each uses only those above it): `clock`, `tuning` (the cost model's figures),
//! `pool` (peers by model), `queue` (the waiting lines, one per pool), `outlier`, `progress` (whether a peer's engine still sends), `spec` (a peer as configured), `usage` (what an
//! answer says the engine had cached), `prefill` (the rate learned from first bytes), `engine`
//! (what a peer's engine reports and shows), `load` (the counts behind every ceiling), `cost`,
//! `peer` (the live peer), `slot` (one request on it), `hash`, `blocks` (a prompt's chain of block
//! names), `ring`, `record` (where prompt blocks went: its table, then what it answers),
//! `policy` (what is asked and what a choice gave, the view of the cluster a policy reads, one
//! file per policy), `cluster` (membership, eligibility, and the call into the policy),
//! `prompt` (the walk over a JSON body), `key`.

pub mod blocks;
pub mod clock;
pub mod cluster;
pub mod cost;
pub mod engine;
pub mod hash;
pub mod key;
pub mod load;
pub mod outlier;
pub mod peer;
pub mod policy;
pub mod pool;
pub mod prefill;
pub mod progress;
mod prompt;
pub mod queue;
pub mod record;
pub mod responses;
pub mod ring;
pub mod slot;
mod source;
pub mod spec;
pub mod tuning;
pub mod usage;

pub use blocks::{Blocks, Turn, BLOCK_BYTES, MAX_BLOCKS};
pub use cluster::Cluster;
pub use cost::{CostModel, Placement, Pricing};
pub use engine::{CacheReport, EngineReport};
pub use key::{
    BodyEnd, BodyKind, Extract, Fallback, FallbackReason, KeyConfig, KeyExtractor, KeySource,
    RequestParts, RoutingKey,
};
pub use load::ClusterLoad;
pub use outlier::{is_peer_fault, OutlierPolicy};
pub use peer::Peer;
pub use policy::{Balance, Decision, Demand, Policy, Route, Routed, DEFAULT_BALANCE_FACTOR};
pub use pool::{ModelId, PoolChoice};
/// The model a prompt-carrying body asks for, wherever `model` comes in it (after `messages`
/// too); `None` when it has none or is cut before it.
pub use prompt::model as model_in;
pub use queue::{Attempt, Outcome, QueueLimit, Rejection, WaitLines, WaitQueue};
pub use record::{Holdings, PrefixRecord, RecordStats};
pub use responses::{previous_in, IdReader, ResponseHomes};
pub use ring::{Ring, RingConfig, DEFAULT_VNODES_PER_WEIGHT, MAX_VNODES_PER_WEIGHT};
pub use slot::Slot;
pub use spec::{canonical, PeerSpec, Weight, MAX_WEIGHT, UNLIMITED};
pub use tuning::{LearnedRate, Tuning};
pub use usage::{Usage, UsageReader};
