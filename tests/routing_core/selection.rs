//! Which peer each policy picks: overflow clockwise from a full primary, a hot key bounded by
//! the balance factor, pure consistent hashing, saturation told from no peer, peers skipped,
//! round robin and least-in-flight by weight, and a model served only by its pool.

use std::sync::Arc;

use prefixlb::routing::*;
use proptest::prelude::*;

use crate::{key, primary_id, spec, uniform, BOUNDED};

/// `policy` with no balance bound.
fn unbounded(policy: Policy) -> Balance {
    Balance {
        policy,
        balance_factor: None,
        cost: CostModel::DEFAULT,
    }
}

#[test]
fn full_primary_overflows_clockwise_to_the_next_peer() {
    let cluster = Cluster::new(&uniform(5, 2), RingConfig::default());
    let balance = unbounded(Policy::BoundedConsistentHash);
    let h = key(42);
    let walk: Vec<usize> = cluster.ring().walk(h).collect();
    let a = cluster.select(&balance, Some(h), &[]).routed().unwrap();
    let b = cluster.select(&balance, Some(h), &[]).routed().unwrap();
    assert!(Arc::ptr_eq(a.slot.peer(), &cluster.peers()[walk[0]]));
    assert!(Arc::ptr_eq(b.slot.peer(), &cluster.peers()[walk[0]]));
    let c = cluster.select(&balance, Some(h), &[]).routed().unwrap();
    assert_eq!(c.route, Route::Overflow);
    assert_eq!(c.steps, 2);
    assert!(Arc::ptr_eq(c.slot.peer(), &cluster.peers()[walk[1]]));
    drop(a);
    let d = cluster.select(&balance, Some(h), &[]).routed().unwrap();
    assert_eq!(
        d.route,
        Route::Primary,
        "a released slot brings the key home"
    );
}

#[test]
fn balance_factor_bounds_a_hot_key() {
    // One hot key, no fixed ceiling: with c = 1.25 over 4 peers, the hot peer holds at most
    // ceil(1.25 · (total + 1) / 4) and the rest spills clockwise.
    let cluster = Cluster::new(&uniform(4, UNLIMITED), RingConfig::default());
    let mut held = Vec::new();
    for _ in 0..40 {
        let total = cluster.in_flight();
        let r = cluster
            .select(&BOUNDED, Some(key(7)), &[])
            .routed()
            .unwrap();
        let bound = (1.25 * (total as f64 + 1.0) / 4.0).ceil() as u32;
        assert!(r.slot.peer().in_flight() <= bound);
        held.push(r.slot);
    }
    let hot = primary_id(&cluster, key(7));
    assert_eq!(
        cluster.peer(&hot).unwrap().in_flight(),
        13,
        "ceil(1.25·40/4)"
    );
    let max = cluster.peers().iter().map(|p| p.in_flight()).max().unwrap();
    assert!(max <= 13);
}

#[test]
fn pure_consistent_hash_ignores_load() {
    let cluster = Cluster::new(&uniform(4, 1), RingConfig::default());
    let balance = unbounded(Policy::ConsistentHash);
    let slots: Vec<_> = (0..10)
        .map(|_| {
            cluster
                .select(&balance, Some(key(1)), &[])
                .routed()
                .unwrap()
        })
        .collect();
    assert!(slots.iter().all(|r| r.route == Route::Primary));
    assert_eq!(
        cluster
            .peer(&primary_id(&cluster, key(1)))
            .unwrap()
            .in_flight(),
        10
    );
}

#[test]
fn saturated_and_no_peer_are_told_apart() {
    let cluster = Cluster::new(&uniform(2, 1), RingConfig::default());
    let held: Vec<_> = (0..2)
        .map(|i| {
            cluster
                .select(&BOUNDED, Some(key(i)), &[])
                .routed()
                .unwrap()
        })
        .collect();
    assert!(matches!(
        cluster.select(&BOUNDED, Some(key(9)), &[]),
        Decision::Saturated
    ));
    drop(held);
    for p in cluster.peers() {
        assert!(cluster.set_healthy(p.id(), false));
    }
    assert!(matches!(
        cluster.select(&BOUNDED, Some(key(9)), &[]),
        Decision::NoPeer
    ));
    assert!(matches!(
        Cluster::new(&[], RingConfig::default()).select(&BOUNDED, Some(1), &[]),
        Decision::NoPeer
    ));
}

#[test]
fn unhealthy_draining_and_excluded_peers_are_skipped() {
    let cluster = Cluster::new(&uniform(4, 8), RingConfig::default());
    let h = key(5);
    let walk: Vec<usize> = cluster.ring().walk(h).collect();
    let ids: Vec<String> = walk
        .iter()
        .map(|&i| cluster.peers()[i].id().to_owned())
        .collect();
    cluster.set_healthy(&ids[0], false);
    cluster.set_draining(&ids[1], true);
    let failed = Arc::clone(&cluster.peers()[walk[2]]);
    let r = cluster
        .select(&BOUNDED, Some(h), std::slice::from_ref(&failed))
        .routed()
        .unwrap();
    assert_eq!(r.slot.peer().id(), ids[3]);
    assert_eq!(
        r.route,
        Route::Primary,
        "the first eligible peer is the key's home"
    );
    assert_eq!(r.steps, 4);
    assert_eq!(cluster.eligible_weight(), 2);
    cluster.set_healthy(&ids[0], true);
    let back = cluster.select(&BOUNDED, Some(h), &[]).routed().unwrap();
    assert_eq!(
        back.slot.peer().id(),
        ids[0],
        "a recovered peer gets its keys back"
    );
}

#[test]
fn round_robin_follows_weights_and_least_in_flight_levels() {
    let specs = vec![spec(0, 1, UNLIMITED), spec(1, 3, UNLIMITED)];
    let cluster = Cluster::new(&specs, RingConfig::default());
    let rr = unbounded(Policy::RoundRobin);
    let mut held = Vec::new();
    for i in 0..40 {
        held.push(
            cluster
                .select(&rr, Some(key(i)), &[])
                .routed()
                .unwrap()
                .slot,
        );
    }
    let light = cluster.peer(&specs[0].addr.to_string()).unwrap();
    assert_eq!(light.in_flight(), 10);
    drop(held);

    let lif = unbounded(Policy::LeastInFlight);
    let held: Vec<_> = (0..8)
        .map(|_| cluster.select(&lif, None, &[]).routed().unwrap().slot)
        .collect();
    assert_eq!(
        light.in_flight(),
        2,
        "in flight per weight is levelled: 2/1 vs 6/3"
    );
    drop(held);
}

#[test]
fn least_in_flight_passes_over_a_wedged_peer_however_light() {
    let specs = vec![spec(0, 1, UNLIMITED), spec(1, 3, UNLIMITED)];
    let cluster = Cluster::new(&specs, RingConfig::default());
    let lif = unbounded(Policy::LeastInFlight);
    let (light, heavy) = (
        cluster.peer(&specs[0].addr.to_string()).unwrap(),
        cluster.peer(&specs[1].addr.to_string()).unwrap(),
    );
    let mut held = vec![light.take()];
    held.extend((0..4).map(|_| heavy.take()));
    // One request on it and no byte for longer than the limit: wedged, at 1 per weight against
    // the other's 4 per 3.
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert!(light
        .check_progress(std::time::Duration::from_millis(1))
        .is_some());
    assert!(light.wedged());
    let routed = cluster
        .select(&lif, None, &[])
        .routed()
        .expect("the other peer");
    assert!(Arc::ptr_eq(routed.slot.peer(), heavy));
    drop(held);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// A request for a model only ever gets a slot on a peer that serves it, under every
    /// policy, however loaded the other pool is; a model nobody lists has no pool.
    #[test]
    fn a_model_is_served_only_by_its_pool(seed in any::<u64>(), held in 1usize..40) {
        let mut specs = uniform(6, UNLIMITED);
        for (i, s) in specs.iter_mut().enumerate() {
            s.models = Some(vec![if i < 2 { "small" } else { "large" }.to_owned()]);
        }
        let cluster = Cluster::new(&specs, RingConfig::default());
        let PoolChoice::Model(small) = cluster.pools().choose(Some("small"), None) else {
            panic!("small is listed");
        };
        let PoolChoice::Model(large) = cluster.pools().choose(Some("large"), None) else {
            panic!("large is listed");
        };
        // Load on the large pool only.
        let mut slots = Vec::new();
        for i in 0..held {
            let demand = Demand { model: Some(large), ..Demand::from(Some(key(seed ^ i as u64))) };
            if let Decision::Routed(r) = cluster.select(&BOUNDED, demand, &[]) {
                prop_assert!(r.slot.peer().serves(large));
                slots.push(r.slot);
            }
        }
        for policy in [Policy::LeastCost, Policy::BoundedConsistentHash, Policy::ConsistentHash, Policy::RoundRobin, Policy::LeastInFlight] {
            let balance = Balance { policy, ..BOUNDED };
            for i in 0..20u64 {
                let demand = Demand { model: Some(small), ..Demand::from(Some(key(seed.wrapping_add(i)))) };
                match cluster.select(&balance, demand, &[]) {
                    Decision::Routed(r) => prop_assert!(r.slot.peer().serves(small), "{policy:?}"),
                    other => prop_assert!(false, "{policy:?}: {other:?}"),
                }
            }
        }
        prop_assert_eq!(cluster.pools().choose(Some("medium"), None), PoolChoice::Unknown);
    }
}
