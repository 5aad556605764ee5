//! Prompts no peer is known to hold: priced on their primary as held there but queued whole,
//! sent to their primary until this process is shown alone, and sent where their system prompt
//! went lately.

use std::sync::Arc;

use prefixlb::routing::*;

use crate::{ask, chat, completion, key, specs, streams, walk, COST, PLACED};

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
