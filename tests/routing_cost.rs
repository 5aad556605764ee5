//! `least_cost` on its own: where the cost rule sends a request, the ceilings it never
//! crosses, that equal states choose alike, and that every slot gives back what it counted.

use std::sync::Arc;

use prefixlb::routing::hash::murmur64;
use prefixlb::routing::*;
use proptest::prelude::*;

const COST: Balance = Balance {
    policy: Policy::LeastCost,
    balance_factor: Some(DEFAULT_BALANCE_FACTOR),
    cost: CostModel::DEFAULT,
};

const PLACED: Balance = Balance {
    cost: CostModel {
        shared_prefix_placement: Placement::Always,
        ..CostModel::DEFAULT
    },
    ..COST
};

fn specs(n: usize, max_in_flight: u32) -> Vec<PeerSpec> {
    (0..n)
        .map(|i| PeerSpec::new(format!("10.2.0.{}:8000", i + 1).parse().unwrap()))
        .map(|spec| spec.max_in_flight(max_in_flight))
        .collect()
}

fn key(i: u64) -> u64 {
    murmur64(&i.to_le_bytes())
}

/// The peers of `h`'s walk, in order.
fn walk(c: &Cluster, h: u64) -> Vec<Arc<Peer>> {
    c.ring()
        .walk(h)
        .map(|i| Arc::clone(&c.peers()[i]))
        .collect()
}

/// The first key of `key(from)`, `key(from + 1)`, ... whose primary is (or, `on: false`, is not) `peer`.
fn key_with_primary(c: &Cluster, from: u64, peer: &Arc<Peer>, on: bool) -> u64 {
    (from..)
        .map(key)
        .find(|&k| Arc::ptr_eq(&walk(c, k)[0], peer) == on)
        .unwrap()
}

fn ask(h: u64, tokens: u32) -> Demand {
    Demand {
        prompt_tokens: tokens,
        ..Demand::from(Some(h))
    }
}

/// A chat turn's demand, as the proxy makes it: its key and block chain from the body.
fn chat(messages: &[(&str, &str)]) -> Demand {
    let messages: Vec<_> = messages
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    demand_of(
        "/v1/chat/completions",
        serde_json::json!({"model": "m", "messages": messages}),
    )
}

/// A completions prompt's demand, as the proxy makes it.
fn completion(prompt: &str) -> Demand {
    demand_of(
        "/v1/completions",
        serde_json::json!({"model": "m", "prompt": prompt}),
    )
}

fn demand_of(path: &str, body: serde_json::Value) -> Demand {
    let body = body.to_string();
    let keys = KeyExtractor::default();
    let key = match keys.key_for(&RequestParts {
        method: &http::Method::POST,
        path,
        headers: &http::HeaderMap::new(),
        client: None,
        body: body.as_bytes(),
        end: BodyEnd::Complete,
    }) {
        Extract::Key(k) => k,
        other => panic!("a whole body has a key: {other:?}"),
    };
    keys.demand(&key, body.len())
}

/// `n` requests in flight on `peer`, their prefill done.
fn streams(peer: &Arc<Peer>, n: usize) -> Vec<Slot> {
    (0..n).map(|_| peer.take()).collect()
}

/// Marks `peer` as an engine that runs `slots` requests at once (it was seen to queue).
fn known_slots(peer: &Peer, slots: u32) {
    peer.set_engine(Some(EngineReport {
        running: slots,
        waiting: 1,
        kv_cache_usage: None,
    }));
    // The queue is gone; what it taught of the slots stays.
    peer.set_engine(Some(EngineReport {
        running: 0,
        waiting: 0,
        kv_cache_usage: None,
    }));
}

#[test]
fn concurrent_requests_of_one_key_stay_together_while_its_peer_has_slots() {
    let cluster = Cluster::new(&specs(4, UNLIMITED), RingConfig::default());
    let h = key(1);
    let primary = &walk(&cluster, h)[0];
    // Bounded hashing would split the second request already: ceil(1.25 · 2 / 4) = 1.
    // 2 000 tokens: 0.2 s of prefill on a cold peer, more than the new turns queued here.
    let held: Vec<Routed> = (0..Tuning::DEFAULT.unknown_capacity_floor)
        .map(|_| cluster.select(&COST, ask(h, 2_000), &[]).routed().unwrap())
        .collect();
    assert!(held.iter().all(|r| Arc::ptr_eq(r.slot.peer(), primary)));
    assert!(held.iter().all(|r| r.route == Route::Primary));
    // Once the engine has shown it runs 8, the floor is 8 and the cost rule alone decides: with
    // the four streaming, a fifth costs less here (its new turn, shared with their steps, and
    // their decode share: 0.14 s) than a cold prefill (0.2 s).
    let mut held = held;
    for r in &mut held {
        r.slot.prefilled();
    }
    known_slots(primary, 8);
    let fifth = cluster.select(&COST, ask(h, 2_000), &[]).routed().unwrap();
    assert!(Arc::ptr_eq(fifth.slot.peer(), primary));
}

#[test]
fn a_long_prefill_queue_sends_the_key_to_a_cold_peer_and_it_turns_warm() {
    let cluster = Cluster::new(&specs(4, UNLIMITED), RingConfig::default());
    let h = key(2);
    let peers = walk(&cluster, h);
    // 3 s of prefill ahead on the primary (three 10 000-token prompts of other keys).
    let mut ahead = Vec::new();
    for _ in 0..3 {
        let mut slot = peers[0].take();
        slot.expect_prefill(10_000, 0.0, 10_000);
        ahead.push(slot);
    }
    let spilled = cluster.select(&COST, ask(h, 4_000), &[]).routed().unwrap();
    assert!(Arc::ptr_eq(spilled.slot.peer(), &peers[1]));
    assert_eq!(spilled.route, Route::Overflow);
    drop(spilled);
    // The next peer of the walk is busier now than the third; the one that served the key
    // last holds its newest turns, and wins over the idle cold one.
    let mut other = peers[1].take();
    other.expect_prefill(1_000, 0.0, 1_000);
    let again = cluster.select(&COST, ask(h, 4_000), &[]).routed().unwrap();
    assert!(Arc::ptr_eq(again.slot.peer(), &peers[1]), "went cold");
    assert_eq!(again.route, Route::Replica);
    drop(again);
    // The primary's queue clears, but the conversation moved: it stays where its newest turns
    // are while that peer is cheaper...
    drop(ahead);
    let stays = cluster.select(&COST, ask(h, 4_000), &[]).routed().unwrap();
    assert!(Arc::ptr_eq(stays.slot.peer(), &peers[1]));
    drop(stays);
    // ...and comes home once it is not: the primary still holds the turns up to the spill.
    let mut busy = vec![other];
    for _ in 0..2 {
        let mut slot = peers[1].take();
        slot.expect_prefill(10_000, 0.0, 10_000);
        busy.push(slot);
    }
    let home = cluster.select(&COST, ask(h, 4_000), &[]).routed().unwrap();
    assert_eq!(home.route, Route::Primary);
    drop((home, busy));
    let settled = cluster.select(&COST, ask(h, 4_000), &[]).routed().unwrap();
    assert_eq!(settled.route, Route::Primary, "it served the key last");
}

/// The primary of a prompt no peer holds is priced as holding most of it, since another
/// process may have sent it there; but the prefill it queues there is counted whole, so that
/// the next prompt does not take it for a turn's worth of wait.
#[test]
fn a_prompt_nobody_holds_queues_its_whole_prefill_on_its_primary() {
    let cluster = Cluster::new(&specs(4, UNLIMITED), RingConfig::default());
    let cold = completion(&"Summarise the incident timeline below. ".repeat(400));
    let tokens = u64::from(cold.prompt_tokens);
    let first = cluster.select(&COST, cold, &[]).routed().unwrap();
    assert_eq!(first.route, Route::Primary);
    assert_eq!(first.slot.peer().prefill_queue(), tokens);
    // A key without its prompt is another matter: the record cannot say what its primary
    // holds, and a conversation's later turns come that way (a session header).
    let h = key(7);
    let keyed = cluster.select(&COST, ask(h, 4_000), &[]).routed().unwrap();
    let primary = &walk(&cluster, h)[0];
    assert!(Arc::ptr_eq(keyed.slot.peer(), primary));
    let queued_before = if Arc::ptr_eq(primary, first.slot.peer()) {
        tokens
    } else {
        0
    };
    assert_eq!(primary.prefill_queue() - queued_before, 400);
}

/// A conversation cold everywhere goes to its primary, where any process would send its next
/// turn, until the later turns that came show that the record saw every conversation (no
/// other process routes them); from then on it goes where it costs least.
#[test]
fn a_cold_conversation_goes_where_it_costs_least_once_this_process_is_shown_alone() {
    let cluster = Cluster::new(&specs(4, UNLIMITED), RingConfig::default());
    // About 5 000 tokens of a system prompt nobody holds.
    let opening = |name: &str| {
        let system = format!("You are {name}'s assistant. {}", "Be brief. ".repeat(2_000));
        chat(&[("system", &system), ("user", "Where do I start?")])
    };
    let primary_of = |d: &Demand| walk(&cluster, d.hash.unwrap())[0].clone();
    let first = opening("Ada");
    let primary = primary_of(&first);
    // Three streams there: the cold prefill beside them costs more than on an idle peer.
    let busy = streams(&primary, 3);
    let r = cluster.select(&COST, first, &[]).routed().unwrap();
    assert!(Arc::ptr_eq(r.slot.peer(), &primary), "new: to its primary");
    drop((r, busy));
    // Later turns of conversations this process opened, as a lone process sees them.
    for i in 0..300 {
        let name = format!("user {i}");
        let turn = [("system", "Be kind."), ("user", name.as_str())];
        drop(cluster.select(&COST, chat(&turn), &[]).routed());
        let later = [
            turn[0],
            turn[1],
            ("assistant", "Hello."),
            ("user", "And then?"),
        ];
        drop(cluster.select(&COST, chat(&later), &[]).routed());
    }
    let second = opening("Grace");
    let primary = primary_of(&second);
    let _busy = streams(&primary, 3);
    let r = cluster.select(&COST, second, &[]).routed().unwrap();
    assert!(
        !Arc::ptr_eq(r.slot.peer(), &primary),
        "alone: where it costs least"
    );
    assert_eq!(r.slot.peer().load(), 1);
}

/// With shared-prefix placement, a conversation new to this process, whose system prompt it
/// sent to one peer lately, is priced there as holding that share of its prompt: it goes there
/// rather than to a cold primary, and its next turn follows it.
#[test]
fn a_new_conversation_goes_where_its_system_prompt_is() {
    let cluster = Cluster::new(&specs(6, UNLIMITED), RingConfig::default());
    let system = "Answer from the attached protocol. ".repeat(1_000);
    let opening = |i: usize| format!("question {i}");
    let first = cluster
        .select(
            &PLACED,
            chat(&[("system", &system), ("user", &opening(0))]),
            &[],
        )
        .routed()
        .unwrap();
    let holder = Arc::clone(first.slot.peer());
    assert_eq!(
        first.route,
        Route::Primary,
        "nothing known yet: its own primary"
    );
    drop(first);
    // Another conversation on that system prompt whose walk does not start at the holder.
    let primary_of = |d: &Demand| Arc::clone(&walk(&cluster, d.hash.unwrap())[0]);
    let away = |from: usize| {
        (from..)
            .find(|&i| {
                let d = chat(&[("system", &system), ("user", &opening(i))]);
                !Arc::ptr_eq(&primary_of(&d), &holder)
            })
            .unwrap()
    };
    let next = away(1);
    let turn1 = [("system", system.as_str()), ("user", &opening(next))];
    let r = cluster.select(&PLACED, chat(&turn1), &[]).routed().unwrap();
    assert!(Arc::ptr_eq(r.slot.peer(), &holder), "went cold");
    assert_eq!(r.route, Route::Replica);
    drop(r);
    let turn2 = [
        turn1[0],
        turn1[1],
        ("assistant", "an answer"),
        ("user", "and then?"),
    ];
    let r = cluster.select(&PLACED, chat(&turn2), &[]).routed().unwrap();
    assert!(Arc::ptr_eq(r.slot.peer(), &holder), "lost its newest turns");
    drop(r);
    // Without shared-prefix placement (the default) an opening goes there too: it is new to
    // every process.
    let third = away(next + 1);
    let r = cluster
        .select(
            &COST,
            chat(&[("system", &system), ("user", &opening(third))]),
            &[],
        )
        .routed()
        .unwrap();
    assert!(Arc::ptr_eq(r.slot.peer(), &holder), "an opening went cold");
    drop(r);
    // A later turn this process has not seen is new with shared-prefix placement...
    let later_turn = |i: usize| {
        chat(&[
            ("system", &system),
            ("user", &opening(i)),
            ("assistant", "an answer"),
            ("user", "and then?"),
        ])
    };
    let fourth = away(third + 1);
    let r = cluster
        .select(&PLACED, later_turn(fourth), &[])
        .routed()
        .unwrap();
    assert!(Arc::ptr_eq(r.slot.peer(), &holder), "went cold");
    drop(r);
    // ...and by default may have been sent to its primary by another process, where it is
    // priced as held.
    let fifth = away(fourth + 1);
    let r = cluster
        .select(&COST, later_turn(fifth), &[])
        .routed()
        .unwrap();
    assert_eq!(r.route, Route::Primary);
}

#[test]
fn a_conversation_stays_with_its_history_where_a_new_one_would_not() {
    let cluster = Cluster::new(&specs(4, UNLIMITED), RingConfig::default());
    let peers = cluster.peers().to_vec();
    let (home, other) = (&peers[0], &peers[1]);
    // One department's protocol, one doctor's long first turn, and the short turn after it.
    let protocol = "Follow the ward's protocol. ".repeat(300);
    let turn0 = format!("{protocol}Doctor: {}\nAssistant: ", "chart ".repeat(700));
    let turn1 = format!("{turn0}noted\nDoctor: and the dose?\nAssistant: ");
    cluster
        .record()
        .record(&completion(&turn0).blocks, home.serial());
    let elsewhere = format!("{protocol}Doctor: {}\nAssistant: ", "scan ".repeat(800));
    cluster
        .record()
        .record(&completion(&elsewhere).blocks, other.serial());
    // Home runs five, above a new conversation's floor (4) while its slots are unknown; the
    // others run two each, so the balance bound is 4 too.
    let _held = [
        streams(home, 5),
        streams(other, 2),
        streams(&peers[2], 2),
        streams(&peers[3], 2),
    ];
    let r = cluster
        .select(&COST, completion(&turn1), &[])
        .routed()
        .unwrap();
    assert!(Arc::ptr_eq(r.slot.peer(), home), "left its history");
    drop(r);
    // A new conversation on the same protocol is held by both alike, and home is full for it.
    let new = format!("{protocol}Doctor: {}\nAssistant: ", "triage ".repeat(600));
    let r = cluster
        .select(&COST, completion(&new), &[])
        .routed()
        .unwrap();
    assert!(
        !Arc::ptr_eq(r.slot.peer(), home),
        "a new conversation piled on"
    );
}

/// A 6 000-token protocol recorded on the cluster's first two peers, each running `busy`
/// streams (held by the slots returned), and the opening of a new conversation on it.
fn protocol_on_two_busy_peers(cluster: &Cluster, busy: usize) -> (String, [Vec<Slot>; 2]) {
    let peers = cluster.peers();
    let protocol = "Follow the ward's protocol. ".repeat(880);
    let earlier = format!("{protocol}Doctor: {}\nAssistant: ", "scan ".repeat(400));
    for warm in &peers[..2] {
        cluster
            .record()
            .record(&completion(&earlier).blocks, warm.serial());
    }
    let held = [streams(&peers[0], busy), streams(&peers[1], busy)];
    let new = format!("{protocol}Doctor: {}\nAssistant: ", "triage ".repeat(400));
    (new, held)
}

#[test]
fn a_new_conversation_warms_an_idle_peer_when_the_warm_ones_are_busy() {
    let cluster = Cluster::new(&specs(4, UNLIMITED), RingConfig::default());
    let peers = cluster.peers().to_vec();
    let (new, _held) = protocol_on_two_busy_peers(&cluster, 3);
    // This turn alone is cheaper on a warm peer (700 new tokens beside three streams and a
    // quarter of one to come: 0.33 s) than on a cold one (6 900 tokens: 0.86 s); with the
    // conversation's turns to come, each as large and beside three streams there or none, the
    // cold peer is cheaper.
    let r = cluster
        .select(&COST, completion(&new), &[])
        .routed()
        .unwrap();
    let chosen = r.slot.peer();
    assert!(
        peers[2..].iter().any(|p| Arc::ptr_eq(p, chosen)),
        "stayed on a busy warm peer"
    );
    assert_eq!(chosen.load(), 1);
}

#[test]
fn a_second_copy_of_a_prefix_needs_a_free_slot() {
    // Placed as new by this process alone (no primary is priced as holding the conversation),
    // and no balance bound: only the prices choose.
    let room = Balance {
        balance_factor: None,
        ..PLACED
    };
    let anywhere = Balance {
        cost: CostModel {
            tuning: Tuning {
                copies_need_room: false,
                ..Tuning::DEFAULT
            },
            ..PLACED.cost
        },
        ..room
    };
    // The protocol on two peers running twelve streams each, and a third, cold, whose
    // engine runs two at once, with `taken` of them running: whether a new conversation on the
    // protocol goes to the cold one.
    let goes_cold = |balance: &Balance, taken: usize| {
        let cluster = Cluster::new(&specs(3, UNLIMITED), RingConfig::default());
        let peers = cluster.peers().to_vec();
        let (new, _busy) = protocol_on_two_busy_peers(&cluster, 12);
        known_slots(&peers[2], 2);
        let _running = streams(&peers[2], taken);
        let r = cluster
            .select(balance, completion(&new), &[])
            .routed()
            .unwrap();
        Arc::ptr_eq(r.slot.peer(), &peers[2])
    };
    // A slot free: the copy goes there, and the prefix has a second home.
    assert!(goes_cold(&room, 1));
    // Both slots taken: the copy would only queue there, so a warm peer takes it; with
    // `copies_need_room` off, the price still sends it to the cold one.
    assert!(!goes_cold(&room, 2));
    assert!(goes_cold(&anywhere, 2));
}

#[test]
fn a_full_engine_is_priced_by_its_queue() {
    let cluster = Cluster::new(&specs(3, UNLIMITED), RingConfig::default());
    let h = key(3);
    let peers = walk(&cluster, h);
    known_slots(&peers[0], 2);
    let held: Vec<Slot> = (0..2).map(|_| peers[0].take()).collect();
    // Both slots are taken: a third would wait half a stream time (0.5 s assumed) behind them,
    // dearer than a cold 1 000-token prefill elsewhere (0.1 s).
    let r = cluster.select(&COST, ask(h, 1_000), &[]).routed().unwrap();
    assert!(!Arc::ptr_eq(r.slot.peer(), &peers[0]));
    // Another key of the same primary, once a slot is free, goes home.
    let other = key_with_primary(&cluster, 4, &peers[0], true);
    drop(held);
    let r = cluster
        .select(&COST, ask(other, 1_000), &[])
        .routed()
        .unwrap();
    assert!(Arc::ptr_eq(r.slot.peer(), &peers[0]));
}

#[test]
fn a_request_without_a_key_or_prompt_is_still_routed() {
    let cluster = Cluster::new(&specs(3, 1), RingConfig::default());
    let a = cluster.select(&COST, None, &[]).routed().unwrap();
    let b = cluster.select(&COST, Some(key(4)), &[]).routed().unwrap();
    assert!(!Arc::ptr_eq(a.slot.peer(), b.slot.peer()));
    let c = cluster.select(&COST, Some(key(4)), &[]).routed().unwrap();
    assert!(matches!(
        cluster.select(&COST, Some(key(4)), &[]),
        Decision::Saturated
    ));
    drop((a, b, c));
    assert_eq!(cluster.in_flight(), 0);
}

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
