//! The ring and bounded selection as properties: no peer above its bound under eight threads,
//! a key on its primary while nothing is in flight, a membership change moving only the
//! changed share, key shares following weights; and the ring as Pingora's selection algorithm.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use pingora_load_balancing::discovery::Static;
use pingora_load_balancing::{Backend, Backends, LoadBalancer};
use prefixlb::routing::*;
use proptest::prelude::*;

use crate::{key, primary_id, spec, uniform, BOUNDED};

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
