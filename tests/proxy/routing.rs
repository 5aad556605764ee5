//! Where requests go: conversations stick to one upstream across turns, a full primary
//! overflows to the next ring peer, and the prefix record (and the replicas that share it)
//! sends a turn where its own history is.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::{post_chat, upstream_of, CHAT};

/// Every conversation keeps its upstream across turns. Conversations with prompts of their own
/// spread by their keys; those that open on a system prompt one upstream holds go there while it
/// is idle, since a prefill of the shared part is saved there and nothing is paid for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_stick_to_one_upstream_across_turns() {
    stick_and_share(false).await;
}

/// The same with each conversation named in a session header: the header gives its point on
/// the ring, and the body is still read, so that a new session finds the upstream that holds
/// its system prompt instead of the one its name hashes to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_in_a_header_stick_and_find_their_shared_prompt() {
    stick_and_share(true).await;
}

async fn stick_and_share(session_header: bool) {
    let ups = upstreams::<3>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let shared = "You are the triage assistant of St. Mary's. ".repeat(30);
    let (mut own_homes, mut shared_homes) = (HashSet::new(), HashSet::new());
    for conv in 0..24 {
        let own = format!("You are the assistant of ward {conv}. ").repeat(30);
        let system = if conv % 2 == 0 { &own } else { &shared };
        let mut seen = HashSet::new();
        for turn in 1..=5 {
            let body = chat(system, &format!("patient {conv}"), turn, false);
            let r = if session_header {
                c.post(proxy.url(CHAT))
                    .header("x-session-id", format!("session {conv}"))
                    .body(body)
                    .send()
                    .await
                    .unwrap()
            } else {
                post_chat(&c, &proxy, body).await
            };
            assert_eq!(r.status(), 200);
            seen.insert(upstream_of(&r));
        }
        assert_eq!(seen.len(), 1, "conversation {conv} moved: {seen:?}");
        if conv % 2 == 0 {
            own_homes.extend(seen);
        } else {
            shared_homes.extend(seen);
        }
    }
    assert!(
        own_homes.len() >= 2,
        "12 conversations all landed on {own_homes:?}"
    );
    assert_eq!(shared_homes.len(), 1, "{shared_homes:?}");
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_primary_overflows_to_the_next_ring_peer_and_the_key_comes_back() {
    let ups = upstreams::<3>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .max_in_flight(1)
        .balance_factor(None);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let body = chat("sys", "the hot conversation", 1, true);
    let home = upstream_of(&post_chat(&c, &proxy, body.clone()).await);

    // Hold the primary's only slot with a long stream.
    let long = c
        .post(proxy.url(CHAT))
        .header("x-mock-events", "10")
        .header("x-mock-interval-ms", "100")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(upstream_of(&long), home);
    let during = post_chat(&c, &proxy, body.clone()).await;
    assert_eq!(during.status(), 200);
    assert_ne!(
        upstream_of(&during),
        home,
        "the full primary was not skipped"
    );
    let _ = long.bytes().await.unwrap();

    proxy.wait_idle(Duration::from_secs(5)).await;
    let after = post_chat(&c, &proxy, body).await;
    assert_eq!(upstream_of(&after), home, "the key did not come home");
}

async fn post_prompt(
    c: &reqwest::Client,
    proxy: &Proxy,
    prompt: &str,
    stream_ms: Option<u32>,
) -> reqwest::Response {
    let body = serde_json::json!({"model": "m", "stream": true, "prompt": prompt}).to_string();
    let mut req = c.post(proxy.url("/v1/completions")).body(body);
    if let Some(ms) = stream_ms {
        req = req
            .header("x-mock-events", "20")
            .header("x-mock-interval-ms", (ms / 20).to_string());
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200);
    r
}

/// Turn `n` of doctor `who`'s conversation, sent as one growing completions prompt after the
/// ward's shared template (8 KiB: its first 2048 characters are every conversation's key).
fn ward_turn(who: &str, n: usize) -> String {
    let mut p = "Protocol of the ward: check, chart, report. ".repeat(200);
    for t in 1..=n {
        p.push_str(&format!(
            "Doctor {who}, turn {t}: {}\nAssistant: ",
            "symptom ".repeat(500)
        ));
        if t < n {
            p.push_str("noted.\n");
        }
    }
    p
}

/// Conversations sent as one growing completions prompt share one key (the template's first
/// 2048 characters): the record of where their blocks went is what tells them apart. A turn
/// goes where its own history is, not where the template went last, and the record counts
/// its blocks in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_follows_its_own_history_inside_a_shared_prompt() {
    let ups = upstreams::<3>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .max_in_flight(1)
        .prefix_record_mib(2);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let home = upstream_of(&post_prompt(&c, &proxy, &ward_turn("a", 1), None).await);
    // B's first turn finds the template's peer full and goes elsewhere.
    let held = post_prompt(&c, &proxy, &ward_turn("a", 1), Some(2_000)).await;
    assert_eq!(upstream_of(&held), home);
    let b = upstream_of(&post_prompt(&c, &proxy, &ward_turn("b", 1), None).await);
    assert_ne!(b, home, "the full peer was not skipped");
    let _ = held.bytes().await.unwrap();
    proxy.wait_idle(Duration::from_secs(5)).await;
    // C's first turn goes home, which served the template last.
    let c1 = upstream_of(&post_prompt(&c, &proxy, &ward_turn("c", 1), None).await);
    assert_eq!(c1, home);
    // B's second turn goes to B's history, not to where the template went last.
    let b2 = upstream_of(&post_prompt(&c, &proxy, &ward_turn("b", 2), None).await);
    assert_eq!(b2, b, "B's turn 2 lost its history");
    let m = proxy.metrics().await;
    let gauge = |name: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    let budget = (2 << 20) as f64;
    let bytes = gauge("prefixlb_prefix_record_bytes");
    assert!(bytes <= budget && bytes > budget * 0.99, "{bytes}");
    // Template and turns: at least the template's 8 blocks and each turn's own.
    assert!(gauge("prefixlb_prefix_record_entries") >= 10.0);
    assert_eq!(gauge("prefixlb_prefix_record_evictions_total"), 0.0);
    // Raw prompts show nothing of other processes: none is a chat's later turn.
    let unseen = gauge("prefixlb_prefix_record_unseen_later_turns_ratio");
    assert_eq!(unseen, 1.0, "taken as alone without a chat's later turn");
    proxy.assert_idle().await;
}

/// Replicas that tell each other where prompts went: a conversation one of them moved off its
/// full peer is followed there by another, which never saw it; a process not told sends the
/// next turn where the shared prompt's key goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_sends_a_turn_where_another_replica_sent_its_conversation() {
    let ups = upstreams::<3>().await;
    let base = TestConfig::new()
        .peers(&ups)
        .max_in_flight(1)
        .prefix_record_mib(2);
    let told = replicas(2);
    let a = start_proxy(&base.clone().replica(&told[0])).await;
    let b = start_proxy(&base.clone().replica(&told[1])).await;
    let apart = start_proxy(&base).await;
    let c = client();
    let held = post_prompt(&c, &a, &ward_turn("a", 1), Some(2_000)).await;
    let home = upstream_of(&held);
    let moved = upstream_of(&post_prompt(&c, &a, &ward_turn("b", 1), None).await);
    assert_ne!(moved, home, "the full peer was not skipped");
    let _ = held.bytes().await.unwrap();
    a.wait_idle(Duration::from_secs(5)).await;

    let heard = |m: String| sample(&m, r#"prefixlb_replica_messages_total{event="heard"}"#);
    let start = Instant::now();
    while heard(b.metrics().await) < 2.0 {
        assert!(start.elapsed() < Duration::from_secs(5), "b heard nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let via_b = upstream_of(&post_prompt(&c, &b, &ward_turn("b", 2), None).await);
    assert_eq!(via_b, moved, "b did not follow the conversation a moved");
    let via_apart = upstream_of(&post_prompt(&c, &apart, &ward_turn("b", 2), None).await);
    assert_eq!(
        via_apart, home,
        "a process not told sends it where its key goes"
    );

    // What an address that is no replica's sends is refused.
    use prefixlb::control::replicas::{encode_entry, MAGIC};
    let b_listen = told[1].listen;
    let mut stray = MAGIC.to_vec();
    assert!(encode_entry(&mut stray, &ups[0].addr_str(), &[1, 2, 3]));
    let from = std::net::UdpSocket::bind("127.0.0.2:0").unwrap();
    from.send_to(&stray, b_listen).unwrap();
    let refused =
        |m: String| sample(&m, r#"prefixlb_replica_messages_total{event="refused"}"#) == 1.0;
    let start = Instant::now();
    while !refused(b.metrics().await) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the stray datagram was not refused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        heard(b.metrics().await),
        2.0,
        "b recorded the stray datagram"
    );
    for p in [&a, &b, &apart] {
        p.assert_idle().await;
    }
}
