//! Keys among busy peers: a key's concurrent requests stay together while its peer has slots,
//! a long prefill queue or a full engine sends the next elsewhere (but a conversation's turn,
//! or a new one on a long document, waits for a slot at home while that costs less and half
//! home's slots, or of the conversation floor while they are unknown, wait beyond them at
//! most), and a request without a key or prompt is still routed until every peer is at its
//! ceiling.

use std::sync::Arc;

use prefixlb::routing::*;

use crate::{ask, chat, key, known_slots, specs, streams, walk, COST};

/// The first key of `key(from)`, `key(from + 1)`, ... whose primary is (or, `on: false`, is not) `peer`.
fn key_with_primary(c: &Cluster, from: u64, peer: &Arc<Peer>, on: bool) -> u64 {
    (from..)
        .map(key)
        .find(|&k| Arc::ptr_eq(&walk(c, k)[0], peer) == on)
        .unwrap()
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

/// The next turn of a ward conversation whose 6 000-token opening `home` alone served, so
/// that no other peer holds any of it.
fn ward_turn(cluster: &Cluster, home: &Peer) -> Demand {
    let chart = "chart ".repeat(4_000);
    let opening = [
        ("system", "You are a ward assistant."),
        ("user", chart.as_str()),
    ];
    let turn = [
        opening[0],
        opening[1],
        ("assistant", "noted"),
        ("user", "and the dose?"),
    ];
    cluster
        .record()
        .record(&chat(&opening).blocks, home.serial());
    chat(&turn)
}

#[test]
fn a_turn_waits_for_a_slot_at_home_rather_than_prefill_its_history_elsewhere() {
    let cluster = Cluster::new(&specs(2, UNLIMITED), RingConfig::default());
    let peers = cluster.peers().to_vec();
    let (home, other) = (&peers[0], &peers[1]);
    let turn = ward_turn(&cluster, home);
    // Both engines run two at once; home's two are taken, the other idles. The balance bound
    // (1.25 · 3 / 2) and home's slots are two, but a conversation's home is bounded no lower
    // than the conversation floor (8), and waiting there for a slot (half a stream: 0.25 s)
    // costs less than prefilling the 6 000-token history on the other engine (0.75 s).
    known_slots(home, 2);
    known_slots(other, 2);
    let _held = streams(home, 2);
    let r = cluster.select(&COST, turn, &[]).routed().unwrap();
    assert!(Arc::ptr_eq(r.slot.peer(), home), "left its history");
}

/// How many of a ward conversation's turns `home` holds, from eight streams on, before the
/// next one goes to the other peer; both engines' slots known as `slots`, or unknown.
fn held_before_a_turn_leaves(slots: Option<u32>) -> usize {
    let cluster = Cluster::new(&specs(2, UNLIMITED), RingConfig::default());
    let peers = cluster.peers().to_vec();
    let (home, other) = (&peers[0], &peers[1]);
    if let Some(slots) = slots {
        known_slots(home, slots);
        known_slots(other, slots);
    }
    let mut held = streams(home, 8);
    loop {
        let r = cluster.select(&COST, ward_turn(&cluster, home), &[]);
        let slot = r.routed().unwrap().slot;
        if Arc::ptr_eq(slot.peer(), other) {
            return held.len();
        }
        held.push(slot);
    }
}

#[test]
fn home_queues_half_its_slots_beyond_them_before_a_turn_leaves() {
    // Engines of eight slots: with three turns waiting at home a fourth waits 4/8 of a
    // stream (0.25 s), less than the other engine's 0.75 s prefill, and home takes up to
    // 8 + 4 whatever the balance bound (1.25 · 12 / 2 = 8).
    assert_eq!(held_before_a_turn_leaves(Some(8)), 12);
}

#[test]
fn home_queues_beyond_the_floor_before_its_engine_has_shown_its_slots() {
    // Neither engine has queued yet, so no wait is priced: home costs its streams' decode
    // share (0.02 s each), the other engine the history's prefill (0.6 s). The conversation
    // floor (8) stands in for home's slots, and half of it more may queue there, as behind
    // known slots: twelve, whatever the balance bound.
    assert_eq!(held_before_a_turn_leaves(None), 12);
}

/// A new conversation on a 15 000-token document whose earlier conversation `home` alone
/// served.
fn on_the_document(cluster: &Cluster, home: &Peer) -> Demand {
    let document = "clause ".repeat(9_000);
    let earlier = [("system", document.as_str()), ("user", "summarise it")];
    cluster
        .record()
        .record(&chat(&earlier).blocks, home.serial());
    chat(&[("system", document.as_str()), ("user", "and clause nine?")])
}

#[test]
fn a_new_conversation_queues_at_its_documents_peer_rather_than_prefill_it_again() {
    let only_conversations = Balance {
        cost: CostModel {
            tuning: Tuning {
                prefix_home_share: 1.0,
                ..Tuning::DEFAULT
            },
            ..CostModel::DEFAULT
        },
        ..COST
    };
    for (balance, stays) in [(COST, true), (only_conversations, false)] {
        let cluster = Cluster::new(&specs(2, UNLIMITED), RingConfig::default());
        let peers = cluster.peers().to_vec();
        let (home, other) = (&peers[0], &peers[1]);
        // Engines of eight slots, home's all taken: the balance bound (1.25 · 9 / 2 = 6) and
        // home's slots refuse a ninth there, but home, its queue priced for this turn and the
        // three to come (1.5 s), costs less than prefilling the document on the other engine
        // (2.0 s).
        known_slots(home, 8);
        known_slots(other, 8);
        let _held = streams(home, 8);
        let r = cluster.select(&balance, on_the_document(&cluster, home), &[]);
        let r = r.routed().unwrap();
        assert_eq!(Arc::ptr_eq(r.slot.peer(), home), stays, "{balance:?}");
    }
}

/// Whether `request` (made for `home` by the function given) stays at home on the first of
/// two peers while another prompt's `ahead` tokens are in prefill there and the other idles.
fn stays_behind_a_prefill(ahead: u32, request: fn(&Cluster, &Peer) -> Demand) -> bool {
    let cluster = Cluster::new(&specs(2, UNLIMITED), RingConfig::default());
    let peers = cluster.peers().to_vec();
    let (home, other) = (&peers[0], &peers[1]);
    let demand = request(&cluster, home);
    let mut prefilling = home.take();
    prefilling.expect_prefill(ahead, 0.0, u64::from(ahead));
    let r = cluster.select(&COST, demand, &[]).routed().unwrap();
    let at_home = Arc::ptr_eq(r.slot.peer(), home);
    assert_eq!(Arc::ptr_eq(r.slot.peer(), other), !at_home);
    at_home
}

#[test]
fn a_new_conversation_leaves_its_documents_peer_only_for_a_clear_gain() {
    // Elsewhere the 15 000-token document is prefilled again, with the requests to come
    // waiting it out: 2.0 s. At home: the wait for the prefill ahead (2.05 or 4.0 s) and the
    // new question. Home is left only for a gain of more than a quarter of that second
    // prefill (0.4 s).
    for (ahead, stays) in [(20_500, true), (40_000, false)] {
        let at_home = stays_behind_a_prefill(ahead, on_the_document);
        assert_eq!(at_home, stays, "{ahead} tokens ahead: at home {at_home}");
    }
}

#[test]
fn a_turn_its_peer_alone_served_leaves_only_for_a_share_of_homes_cost() {
    // Elsewhere the 6 000-token history is prefilled again: 0.75 s with the requests to come.
    // A conversation's own turn leaves for a gain of more than a quarter of home's cost, its
    // system prompt held elsewhere or not: at 9 400 tokens ahead home costs about 0.96 s,
    // which a quarter of the copy's prefill (0.15 s) alone would not keep; at 12 000, 1.22 s.
    for (ahead, stays) in [(9_400, true), (12_000, false)] {
        let at_home = stays_behind_a_prefill(ahead, ward_turn);
        assert_eq!(at_home, stays, "{ahead} tokens ahead: at home {at_home}");
    }
}
