//! Prefixes held on more than one peer: a conversation stays with its history, a new one warms
//! an idle peer when the warm ones are busy, and a second copy of a prefix needs a free slot.

use std::sync::Arc;

use prefixlb::routing::*;

use crate::{completion, known_slots, specs, streams, COST, PLACED};

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
