//! Sessions named in a header: priced by the prompts their bodies carry, and found by their
//! names when a body carries none.

use std::sync::Arc;

use prefixlb::routing::*;

use crate::{demand_with, session_chat, specs, walk, COST};

#[test]
fn a_turn_known_by_its_session_alone_goes_where_the_session_went() {
    let cluster = Cluster::new(&specs(3, UNLIMITED), RingConfig::default());
    let lease = "Clause of the lease: the tenant pays the deposit. ".repeat(200);
    let opening = |session: &str| {
        session_chat(
            Some(session),
            &[("system", &lease), ("user", &format!("{session} asks"))],
        )
    };
    // One session opens on the lease first: its engine holds it.
    let r = cluster
        .select(&COST, opening("first"), &[])
        .routed()
        .unwrap();
    let holder = Arc::clone(r.slot.peer());
    drop(r);
    // A session whose name hashes to another peer opens on the same lease: it goes where
    // the lease is, its prompt priced from the body.
    let name = (0..)
        .map(|i| format!("session {i}"))
        .find(|n| !Arc::ptr_eq(&walk(&cluster, opening(n).hash.unwrap())[0], &holder))
        .unwrap();
    let r = cluster.select(&COST, opening(&name), &[]).routed().unwrap();
    assert!(
        Arc::ptr_eq(r.slot.peer(), &holder),
        "the opening left its lease"
    );
    drop(r);
    // Its next turn's body names no prompt: known by its session alone, it goes where the
    // session went, not to where its name hashes.
    let alone = demand_with("/v1/chat/completions", "not json".into(), Some(&name));
    assert!(alone.session && alone.blocks.key_only());
    let r = cluster.select(&COST, alone, &[]).routed().unwrap();
    assert!(Arc::ptr_eq(r.slot.peer(), &holder), "the session was lost");
}
