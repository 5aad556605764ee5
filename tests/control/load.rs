//! What counts as a peer's load beyond its requests in flight: the queue its engine's metrics
//! report, and prompts waiting on its prefill queue for their first byte.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use crate::{conversation_on, peer, served_by, until};

/// An engine whose metrics report a queue gets no new requests while the queue lasts (what it
/// has beyond this process's requests counts as load), and its keys come back once it clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_reporting_a_queue_is_passed_over_until_it_clears() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .no_health_check()
        .engine_metrics(true)
        .engine_metrics_interval_ms(50);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let conv = conversation_on(&c, &proxy, "a").await;
    let a = ups[0].addr_str();
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a)["engine"]["waiting"] == 0
    })
    .await;
    ups[0].engine_waiting.store(20, Ordering::SeqCst);
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a)["external"] == 20 && peer(l, &a)["engine"]["waiting"] == 20
    })
    .await;
    for _ in 0..3 {
        assert_eq!(served_by(&c, &proxy, &conv).await, "b", "sent into a queue");
    }
    ups[0].engine_waiting.store(0, Ordering::SeqCst);
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a)["external"] == 0
    })
    .await;
    assert_eq!(served_by(&c, &proxy, &conv).await, "a");
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("prefixlb_peer_engine_waiting{peer=\""),
        "{metrics}"
    );
}

/// A prompt is priced whether its key comes from the body or from a session header: until the
/// engine's first byte its uncached share counts on the peer's prefill queue, as
/// `/admin/peers` shows, and the first byte gives it back. A prompt read from the body that no
/// peer holds counts whole, with a session header too (the body is read for its blocks); one
/// known by its session header alone (its body names no prompt) counts all but the newest
/// turn as cached on its own peer (the record cannot say what that peer holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_counts_on_its_peers_prefill_queue_until_the_first_byte() {
    let ups = upstreams::<1>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let per_token = prefixlb::routing::Tuning::DEFAULT.chars_per_token as usize;
    let whole = |body: &str| (body.len() / per_token) as u64;
    let plain = chat("system", &"x".repeat(40_000), 1, false);
    let other = chat("another system", &"y".repeat(40_000), 1, false);
    // A chat route's body whose messages are no list: no prompt, the session's key alone.
    let no_prompt = format!(r#"{{"model":"m","messages":"{}"}}"#, "z".repeat(40_000));
    let turn = |body: &str| {
        (whole(body) as f64 * (1.0 - prefixlb::routing::Tuning::DEFAULT.warm_hit)).ceil() as u64
    };
    let a = ups[0].addr_str();
    let cases = [
        (None, &plain, whole(&plain)),
        (Some("s-1"), &other, whole(&other)),
        (Some("s-2"), &no_prompt, turn(&no_prompt)),
    ];
    for (session, body, expected) in cases {
        let mut req = c
            .post(proxy.url("/v1/chat/completions"))
            .header("x-mock-delay-ms", "1000")
            .body(body.clone());
        if let Some(id) = session {
            req = req.header("x-session-id", id);
        }
        let pending = tokio::spawn(req.send());
        until(&proxy, Duration::from_secs(3), |l| {
            peer(l, &a)["prefill_queue_tokens"] == expected
        })
        .await;
        assert_eq!(pending.await.unwrap().unwrap().status(), 200);
        let listing = proxy.wait_idle(Duration::from_secs(3)).await;
        assert_eq!(peer(&listing, &a)["prefill_queue_tokens"], 0, "{session:?}");
    }
}
