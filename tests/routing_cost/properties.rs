//! Properties over random loads, prompts and engine reports: the ceilings `least_cost` never
//! crosses, that every slot gives back what it counted, and that equal states choose alike.

use std::sync::Arc;

use prefixlb::routing::*;
use proptest::prelude::*;

use crate::{ask, key, specs, COST};

#[derive(Debug, Clone)]
enum Op {
    Select {
        key: u64,
        tokens: u32,
    },
    FirstByte(usize),
    Release(usize),
    /// The engine of a peer reports: running, waiting.
    Engine(usize, u32, u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..12, 0u32..20_000).prop_map(|(key, tokens)| Op::Select { key, tokens }),
        1 => any::<usize>().prop_map(Op::FirstByte),
        2 => any::<usize>().prop_map(Op::Release),
        1 => (any::<usize>(), 0u32..12, 0u32..4).prop_map(|(p, r, w)| Op::Engine(p, r, w)),
    ]
}

/// Runs `ops` on `cluster`, checking every choice against the ceilings; returns the chosen
/// peers' addresses in order (`None` when none was).
fn run(cluster: &Cluster, ops: &[Op], engine: bool) -> Result<Vec<Option<String>>, TestCaseError> {
    let n = cluster.peers().len();
    let mut held: Vec<Slot> = Vec::new();
    let mut chosen = Vec::new();
    for op in ops {
        match *op {
            Op::Select { key: k, tokens } => {
                let before: Vec<u32> = cluster.peers().iter().map(|p| p.load()).collect();
                let total = cluster.in_flight() + cluster.load().external();
                let decision = cluster.select(&COST, ask(key(k), tokens), &[]);
                let Decision::Routed(r) = decision else {
                    // Saturated: every eligible peer is at a ceiling.
                    for p in cluster.peers() {
                        prop_assert!(p.try_take(cluster.bound(&COST, p)).is_none());
                    }
                    chosen.push(None);
                    continue;
                };
                let p = r.slot.peer();
                let i = cluster
                    .peers()
                    .iter()
                    .position(|q| Arc::ptr_eq(q, p))
                    .unwrap();
                // The balance guarantee: past its floor, no peer goes above c · mean.
                let floor = if p.capacity() > 0 {
                    p.capacity()
                } else {
                    Tuning::DEFAULT.unknown_capacity_floor
                };
                let share =
                    (DEFAULT_BALANCE_FACTOR * (total as f64 + 1.0) / n as f64).ceil() as u32;
                prop_assert!(
                    before[i] < floor.max(share),
                    "peer {} took a {}th request (floor {}, share {})",
                    i,
                    before[i] + 1,
                    floor,
                    share
                );
                prop_assert!(before[i] < p.max_in_flight());
                chosen.push(Some(p.id().to_owned()));
                held.push(r.slot);
            }
            Op::FirstByte(i) if !held.is_empty() => {
                let len = held.len();
                held[i % len].prefilled();
            }
            Op::Release(i) if !held.is_empty() => {
                let len = held.len();
                held.swap_remove(i % len);
            }
            Op::Engine(p, running, waiting) if engine => {
                cluster.peers()[p % n].set_engine(Some(EngineReport {
                    running,
                    waiting,
                    kv_cache_usage: None,
                    work: None,
                }));
            }
            _ => {}
        }
    }
    drop(held);
    // Every slot gave back its count and the prefill it expected.
    for p in cluster.peers() {
        prop_assert_eq!(p.in_flight(), 0);
        prop_assert_eq!(p.prefill_queue(), 0);
    }
    prop_assert_eq!(cluster.in_flight(), 0);
    Ok(chosen)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever the loads, prompts and engine reports: no peer above `max_in_flight` or past
    /// the balance bound beyond its floor, a saturated answer only when no ceiling has room,
    /// and every count back to zero at the end.
    #[test]
    fn ceilings_hold_and_slots_give_everything_back(
        n in 2usize..7,
        max in prop::option::of(2u32..10),
        ops in prop::collection::vec(op(), 1..200),
    ) {
        let cluster = Cluster::new(&specs(n, max.unwrap_or(UNLIMITED)), RingConfig::default());
        run(&cluster, &ops, true)?;
    }

    /// Two processes in front of the same peers that see the same requests and the same
    /// releases choose the same peer every time: spills, warm replicas and all.
    #[test]
    fn equal_states_choose_alike(
        n in 2usize..7,
        ops in prop::collection::vec(op(), 1..200),
    ) {
        let a = Cluster::new(&specs(n, 6), RingConfig::default());
        let b = Cluster::new(&specs(n, 6), RingConfig::default());
        prop_assert_eq!(run(&a, &ops, false)?, run(&b, &ops, false)?);
    }
}
