//! The routing core on its own: ring stability, weight shares, bounded-load selection under
//! concurrency, and slot accounting across rebuilds.

mod rebuilds;
mod ring;
mod selection;

use prefixlb::routing::hash::murmur64;
use prefixlb::routing::*;

pub(crate) fn spec(i: usize, weight: u32, max_in_flight: u32) -> PeerSpec {
    PeerSpec::new(
        format!("10.1.{}.{}:8000", i / 250, i % 250 + 1)
            .parse()
            .unwrap(),
    )
    .weight(Weight::new(weight).unwrap())
    .max_in_flight(max_in_flight)
}

pub(crate) fn uniform(n: usize, max: u32) -> Vec<PeerSpec> {
    (0..n).map(|i| spec(i, 1, max)).collect()
}

pub(crate) fn key(i: u64) -> u64 {
    murmur64(&i.to_le_bytes())
}

pub(crate) fn primary_id(c: &Cluster, h: u64) -> String {
    c.peers()[c.ring().primary(h).unwrap()].id().to_owned()
}

pub(crate) const BOUNDED: Balance = Balance {
    policy: Policy::BoundedConsistentHash,
    balance_factor: Some(DEFAULT_BALANCE_FACTOR),
    cost: CostModel::DEFAULT,
};
