//! Passive outlier ejection: which answers eject a peer, the cap on how many are out, and a
//! peer coming back when its ejection runs out.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::{conversation_on, peer, served_by, until, CHAT};

/// A request in `conversation` that the mock engine answers with `status`; returns the status
/// the client got.
async fn answered_with(
    c: &reqwest::Client,
    proxy: &Proxy,
    conversation: &str,
    status: u16,
) -> reqwest::StatusCode {
    c.post(proxy.url(CHAT))
        .header("x-mock-status", status.to_string())
        .body(chat("sys", conversation, 1, false))
        .send()
        .await
        .unwrap()
        .status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_gateway_errors_eject_a_peer_but_4xx_and_500_do_not() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .no_health_check()
        .consecutive_failures(3)
        .ejection_ms(1500, 10000);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let conv = conversation_on(&c, &proxy, "a").await;
    let a = ups[0].addr_str();
    // A client that aims requests the engine refuses, or chokes on, at one session.
    for status in [400, 500] {
        for _ in 0..10 {
            assert_eq!(answered_with(&c, &proxy, &conv, status).await, status);
        }
        assert_eq!(
            peer(&proxy.peers().await, &a)["ejected"],
            false,
            "{status} answers ejected the peer"
        );
    }
    for _ in 0..3 {
        assert_eq!(answered_with(&c, &proxy, &conv, 503).await, 503);
    }
    assert_eq!(peer(&proxy.peers().await, &a)["ejected"], true);
    assert_eq!(
        served_by(&c, &proxy, &conv).await,
        "b",
        "an ejected peer got a request"
    );
    // After the backoff the peer is tried again, and a success restores it.
    until(&proxy, Duration::from_secs(4), |l| {
        peer(l, &a)["ejected"] == false
    })
    .await;
    assert_eq!(served_by(&c, &proxy, &conv).await, "a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_everywhere_eject_no_more_than_the_cap() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .no_health_check()
        .consecutive_failures(2)
        .ejection_ms(10000, 10000)
        .max_ejected_percent(50);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    // Every engine answers 503, to every conversation.
    for i in 0..30 {
        let status = answered_with(&c, &proxy, &format!("c{i}"), 503).await;
        assert_eq!(status, 503, "request {i} found no peer to fail on");
    }
    let listing = proxy.peers().await;
    let ejected = listing["peers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["ejected"] == true)
        .count();
    assert_eq!(ejected, 1, "half of two peers is one: {listing}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_takes_a_peer_whose_ejection_ran_out_without_health_checks() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .max_in_flight(1)
        .no_health_check()
        .reload_interval_ms(50)
        .consecutive_failures(2)
        .ejection_ms(400, 400)
        .max_waiting(4)
        .queue_timeout_ms(10000);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let conv = conversation_on(&c, &proxy, "a").await;
    for _ in 0..2 {
        assert_eq!(answered_with(&c, &proxy, &conv, 502).await, 502);
    }
    assert_eq!(
        peer(&proxy.peers().await, &ups[0].addr_str())["ejected"],
        true
    );
    // b's one slot is taken for 3 s; a is out for 400 ms.
    let held = open_stream(&proxy, 30, 100).await;
    let start = Instant::now();
    let r = c
        .post(proxy.url(CHAT))
        .body(chat("sys", &conv, 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        start.elapsed() < Duration::from_millis(1500),
        "the waiter waited {:?}: nobody told it a was back",
        start.elapsed()
    );
    drop(held);
}
