//! Slot accounting across rebuilds: counts that survive a new peer list and removed peers that
//! drain, a drain racing a reload, and load on peers left out of the bound.

use std::sync::Arc;

use prefixlb::routing::*;

use crate::{key, spec, uniform, BOUNDED};

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

/// At most half the serving peers are ejected (the default), counted among those that serve:
/// peers down or draining serve nothing, and counting them would let every serving one go.
#[test]
fn ejections_leave_half_the_serving_peers_when_others_are_down() {
    use prefixlb::router::Router;
    use prefixlb::settings::RouterSettings;
    let specs = uniform(4, UNLIMITED);
    let router = Router::new(RouterSettings::default(), &specs);
    let ids: Vec<String> = specs.iter().map(|s| s.addr.to_string()).collect();
    let cluster = router.cluster();
    cluster.set_healthy(&ids[0], false);
    cluster.set_draining(&ids[1], true);
    let (a, b) = (
        cluster.peer(&ids[2]).unwrap(),
        cluster.peer(&ids[3]).unwrap(),
    );
    // Five failures in a row eject a peer (the default); both serving peers fail alike.
    let mut ejections = 0;
    for _ in 0..5 {
        for p in [a, b] {
            ejections += usize::from(router.peer_failed(p).is_some());
        }
    }
    assert_eq!(ejections, 1);
    assert!(a.ejected() != b.ejected(), "one of the two still serves");
}

/// What the engine said it carried beyond this process's requests is forgotten with a removed
/// peer: nothing scrapes it any more, and the count would keep it among the peers whose load
/// the bound leaves out, for good.
#[test]
fn a_removed_peer_keeps_no_load_of_others() {
    let specs = uniform(2, UNLIMITED);
    let cluster = Cluster::new(&specs, RingConfig::default());
    let gone = Arc::clone(&cluster.peers()[1]);
    gone.set_engine(Some(EngineReport {
        running: 5,
        waiting: 2,
        kv_cache_usage: None,
        work: None,
    }));
    assert_eq!(gone.external(), 7);
    let rebuilt = cluster.rebuild(&specs[..1], RingConfig::default());
    assert!(gone.removed());
    assert_eq!(gone.external(), 0);
    assert_eq!(rebuilt.load().external(), 0);
}
