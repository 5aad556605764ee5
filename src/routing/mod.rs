//! The routing core: key extraction, hashing, the ring, bounded-load selection and in-flight
//! accounting. Nothing here touches a socket or a Pingora session, so every decision can be
//! tested and benchmarked on its own.

pub mod cluster;
pub mod hash;
pub mod key;
pub mod queue;
pub mod ring;
pub mod select;
pub mod slots;

pub use cluster::{Cluster, PeerSpec};
pub use key::{
    BodyEnd, BodyKind, Extract, Fallback, FallbackReason, KeyConfig, KeyExtractor, KeySource,
    RequestParts, RoutingKey,
};
pub use queue::{QueueLimit, Rejection, WaitQueue};
pub use ring::{Ring, RingConfig, DEFAULT_VNODES_PER_WEIGHT, MAX_WEIGHT};
pub use select::{Balance, Decision, Policy, Route, Routed, DEFAULT_BALANCE_FACTOR};
pub use slots::{ClusterLoad, OutlierPolicy, PeerLoad, Slot, UNLIMITED};
