//! The routing core on its own: ring stability, weight shares, bounded-load selection under
//! concurrency, and slot accounting across rebuilds.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use pingora_load_balancing::discovery::Static;
use pingora_load_balancing::{Backend, Backends, LoadBalancer};
use prefixlb::routing::hash::murmur64;
use prefixlb::routing::*;
use proptest::prelude::*;

fn spec(i: usize, weight: u32, max_in_flight: u32) -> PeerSpec {
    PeerSpec::new(
        format!("10.1.{}.{}:8000", i / 250, i % 250 + 1)
            .parse()
            .unwrap(),
    )
    .weight(Weight::new(weight).unwrap())
    .max_in_flight(max_in_flight)
}

fn uniform(n: usize, max: u32) -> Vec<PeerSpec> {
    (0..n).map(|i| spec(i, 1, max)).collect()
}

fn key(i: u64) -> u64 {
    murmur64(&i.to_le_bytes())
}

fn primary_id(c: &Cluster, h: u64) -> String {
    c.peers()[c.ring().primary(h).unwrap()].id().to_owned()
}

const BOUNDED: Balance = Balance {
    policy: Policy::BoundedConsistentHash,
    balance_factor: Some(DEFAULT_BALANCE_FACTOR),
    cost: CostModel::DEFAULT,
};

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// Eight threads take and release slots as fast as they can; no peer is ever seen above its
    /// `max_in_flight`, and every count is back at zero at the end.
    #[test]
    fn bound_never_exceeded_under_eight_threads(
        n in 2usize..8,
        max in 1u32..6,
        factor in prop::option::of(1.0f64..2.0),
    ) {
        let cluster = Arc::new(Cluster::new(&uniform(n, max), RingConfig::default()));
        let balance = Balance { policy: Policy::BoundedConsistentHash, balance_factor: factor, cost: CostModel::DEFAULT };
        let peak: Arc<Vec<AtomicU32>> = Arc::new((0..n).map(|_| AtomicU32::new(0)).collect());
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (cluster, peak) = (Arc::clone(&cluster), Arc::clone(&peak));
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..3000u64 {
                        if let Decision::Routed(r) = cluster.select(&balance, Some(key(i % 7 + t)), &[]) {
                            let idx = cluster.peers().iter().position(|p| Arc::ptr_eq(p, r.slot.peer())).unwrap();
                            peak[idx].fetch_max(r.slot.peer().in_flight(), Ordering::Relaxed);
                            held.push(r.slot);
                        }
                        if i % 2 == 0 && !held.is_empty() {
                            held.swap_remove((i as usize * 7) % held.len());
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        for p in peak.iter() {
            prop_assert!(p.load(Ordering::Relaxed) <= max);
        }
        prop_assert!(peak.iter().any(|p| p.load(Ordering::Relaxed) == max), "load never reached the bound");
        prop_assert!(cluster.peers().iter().all(|p| p.in_flight() == 0));
        prop_assert_eq!(cluster.in_flight(), 0);
    }

    /// With nothing in flight, a key always lands on its primary peer.
    #[test]
    fn same_key_same_peer_while_unloaded(n in 1usize..64, keys in prop::collection::vec(any::<u64>(), 1..50)) {
        let cluster = Cluster::new(&uniform(n, 4), RingConfig::default());
        for h in keys {
            let first = cluster.select(&BOUNDED, Some(h), &[]).routed().unwrap();
            prop_assert_eq!(first.route, Route::Primary);
            prop_assert_eq!(first.steps, 1);
            let id = first.slot.peer().id().to_owned();
            drop(first);
            let again = cluster.select(&BOUNDED, Some(h), &[]).routed().unwrap();
            prop_assert_eq!(again.slot.peer().id(), id.as_str());
            prop_assert_eq!(id, primary_id(&cluster, h));
        }
    }

    /// Adding a peer to N moves about 1/(N+1) of the keys, all of them to the new peer; removing
    /// one moves exactly the keys it held. Tolerance: the moved share is within 25% of 1/(N+1),
    /// about five standard deviations of a peer's share at the default vnode count plus
    /// sampling noise of 20 000 keys.
    #[test]
    fn membership_change_moves_only_the_changed_share(n in 4usize..40) {
        let before = Cluster::new(&uniform(n, UNLIMITED), RingConfig::default());
        let after = before.rebuild(&uniform(n + 1, UNLIMITED), RingConfig::default());
        let added = spec(n, 1, UNLIMITED).addr.to_string();
        let keys = 20_000u64;
        let mut moved = 0;
        for i in 0..keys {
            let (a, b) = (primary_id(&before, key(i)), primary_id(&after, key(i)));
            if a != b {
                prop_assert_eq!(&b, &added, "a key moved between two unaffected peers");
                moved += 1;
            }
        }
        let expected = keys as f64 / (n + 1) as f64;
        prop_assert!((moved as f64 / expected - 1.0).abs() < 0.25, "moved {} of {}, expected {:.0}", moved, keys, expected);

        // Removing it again restores every key's peer.
        let back = after.rebuild(&uniform(n, UNLIMITED), RingConfig::default());
        for i in 0..keys {
            prop_assert_eq!(primary_id(&before, key(i)), primary_id(&back, key(i)));
        }
    }

    /// Key shares follow weights within ±10% at the default vnode count. The sweep walks the
    /// whole hash space at even steps, so it measures the ring, not sampling noise.
    #[test]
    fn key_shares_follow_weights(weights in prop::collection::vec(1u32..5, 4..48)) {
        let specs: Vec<PeerSpec> = weights.iter().enumerate().map(|(i, &w)| spec(i, w, UNLIMITED)).collect();
        let cluster = Cluster::new(&specs, RingConfig::default());
        let sweep = 400_000u64;
        let mut hits = vec![0u64; specs.len()];
        for s in 0..sweep {
            hits[cluster.ring().primary(s * (u64::MAX / sweep)).unwrap()] += 1;
        }
        let total_w: u32 = weights.iter().sum();
        for (i, peer) in cluster.ring().peers().iter().enumerate() {
            let expected = sweep as f64 * peer.weight as f64 / total_w as f64;
            let dev = hits[i] as f64 / expected - 1.0;
            prop_assert!(dev.abs() < 0.10, "peer {} weight {} off by {:.1}%", i, peer.weight, dev * 100.0);
        }
    }
}

#[test]
fn full_primary_overflows_clockwise_to_the_next_peer() {
    let cluster = Cluster::new(&uniform(5, 2), RingConfig::default());
    let balance = Balance {
        policy: Policy::BoundedConsistentHash,
        balance_factor: None,
        cost: CostModel::DEFAULT,
    };
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
    let balance = Balance {
        policy: Policy::ConsistentHash,
        balance_factor: None,
        cost: CostModel::DEFAULT,
    };
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
    let rr = Balance {
        policy: Policy::RoundRobin,
        balance_factor: None,
        cost: CostModel::DEFAULT,
    };
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

    let lif = Balance {
        policy: Policy::LeastInFlight,
        balance_factor: None,
        cost: CostModel::DEFAULT,
    };
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
fn counts_survive_a_rebuild_and_removed_peers_drain() {
    let old = Cluster::new(&uniform(3, 8), RingConfig::default());
    let held: Vec<_> = (0..20)
        .map(|i| {
            old.select(&BOUNDED, Some(key(i)), &[])
                .routed()
                .unwrap()
                .slot
        })
        .collect();
    let counts: Vec<u32> = old.peers().iter().map(|p| p.in_flight()).collect();
    old.set_draining(old.peers()[1].id(), true);

    // Drop peer 2, add peer 3, change peer 0's weight.
    let specs = vec![spec(0, 2, 8), spec(1, 1, 8), spec(3, 1, 8)];
    let new = old.rebuild(&specs, RingConfig::default());
    assert_eq!(new.peers()[0].in_flight(), counts[0]);
    assert_eq!(new.peers()[0].weight(), 2);
    assert_eq!(new.peers()[1].in_flight(), counts[1]);
    assert!(new.peers()[1].draining(), "drain state survives");
    assert_eq!(new.peers()[2].in_flight(), 0);
    let removed = Arc::clone(&old.peers()[2]);
    assert!(removed.removed() && !removed.eligible());
    assert_eq!(new.in_flight(), 20);
    for i in 0..200 {
        if let Some(r) = new.select(&BOUNDED, Some(key(i)), &[]).routed() {
            assert!(!Arc::ptr_eq(r.slot.peer(), &removed));
        }
    }
    // Re-adding the removed peer while its requests run resumes its count.
    let readded = new.rebuild(&uniform(3, 8), RingConfig::default());
    assert_eq!(readded.peer(removed.id()).unwrap().in_flight(), counts[2]);
    drop(held);
    assert_eq!(removed.in_flight(), 0);
    assert_eq!(readded.in_flight(), 0);
}

#[test]
fn ring_plugs_into_pingora_load_balancer() {
    let backends: BTreeSet<Backend> = (0..6)
        .map(|i| Backend::new(&format!("127.0.0.{}:9000", i + 1)).unwrap())
        .collect();
    let lb: LoadBalancer<Ring> =
        LoadBalancer::from_backends(Backends::new(Static::new(backends.clone())));
    futures_util::FutureExt::now_or_never(lb.update())
        .unwrap()
        .unwrap();
    let ring = Ring::new(backends.into_iter().collect(), RingConfig::default());
    for i in 0..200 {
        let h = key(i);
        let walk: Vec<_> = ring.walk(h).map(|p| ring.peers()[p].clone()).collect();
        let bytes = h.to_be_bytes();
        assert_eq!(lb.select(&bytes, 16).unwrap(), walk[0]);
        // An accept that refuses the primary, as a full peer would be refused, gets the next.
        let next = lb.select_with(&bytes, 16, |b, healthy| healthy && *b != walk[0]);
        assert_eq!(next.unwrap(), walk[1]);
    }
}

/// An admin drain racing a reload must not leave the new cluster counting the drained peer's
/// weight in the bound's denominator.
#[test]
fn a_drain_racing_a_rebuild_lands_on_the_cluster_that_stays() {
    use prefixlb::router::Router;
    use prefixlb::settings::RouterSettings;
    let settings = RouterSettings {
        balance: BOUNDED,
        ring: RingConfig {
            vnodes_per_weight: 4,
        },
        ..RouterSettings::default()
    };
    let lists = [uniform(3, 0), uniform(4, 0)];
    let router = Arc::new(Router::new(settings, &lists[0]));
    let drained = lists[0][0].addr.to_string();
    let rounds = 3000;
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let reloads = {
        let (router, barrier, lists) = (Arc::clone(&router), Arc::clone(&barrier), lists.clone());
        std::thread::spawn(move || {
            for i in 0..rounds {
                barrier.wait();
                router.set_peers(lists[(i + 1) % 2].clone());
                barrier.wait();
            }
        })
    };
    let mut stale = 0;
    for i in 0..rounds {
        barrier.wait();
        // A varying head start, so that some drains fall inside the rebuild.
        for _ in 0..(i * 37) % 2000 {
            std::hint::spin_loop();
        }
        router.set_draining(&drained, i % 2 == 0);
        barrier.wait();
        let cluster = router.cluster();
        let eligible: u64 = cluster
            .peers()
            .iter()
            .filter(|p| p.eligible())
            .map(|p| u64::from(p.weight()))
            .sum();
        stale += usize::from(cluster.eligible_weight() != eligible);
    }
    reloads.join().unwrap();
    assert_eq!(stale, 0, "rounds that left a stale eligible weight");
}

/// The bound is a mean over the peers that may take requests: what a draining or removed peer
/// still carries must not raise the others' ceilings.
#[test]
fn load_on_peers_left_out_does_not_raise_the_bound() {
    let specs = uniform(4, UNLIMITED);
    let cluster = Cluster::new(&specs, RingConfig::default());
    let held: Vec<Slot> = (0..6).map(|_| cluster.peers()[0].take()).collect();
    let drained = cluster.peers()[0].id().to_owned();
    let other = Arc::clone(&cluster.peers()[1]);
    // 6 of 6 in flight are on one of four peers: with all four eligible, the mean is 7/4.
    assert_eq!(cluster.bound(&BOUNDED, &other), 3);
    cluster.set_draining(&drained, true);
    // Three eligible peers carry nothing: ceil(1.25 · (0 + 1) / 3) = 1.
    assert_eq!(cluster.bound(&BOUNDED, &other), 1);
    let rebuilt = cluster.rebuild(&specs[1..], RingConfig::default());
    let other = Arc::clone(rebuilt.peer(other.id()).unwrap());
    assert_eq!(
        rebuilt.bound(&BOUNDED, &other),
        1,
        "a removed peer's requests counted"
    );
    drop(held);
    rebuilt.refresh();
    assert_eq!(rebuilt.bound(&BOUNDED, &other), 1);
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
