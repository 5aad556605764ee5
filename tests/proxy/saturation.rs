//! A full cluster and failing peers: waiting in line, 503s, connect retries, and waiters whose
//! clients leave.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::{post_chat, upstream_of, CHAT};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturation_waits_in_line_then_answers_503() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .balance_factor(None)
        .max_waiting(1)
        .queue_timeout_ms(400);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let hold = |events: u32| {
        c.post(proxy.url(CHAT))
            .header("x-mock-events", events.to_string())
            .header("x-mock-interval-ms", "50")
            .body(chat("s", "holder", 1, true))
            .send()
    };

    // Sends a chat request in the background; yields its status, Retry-After, wait and body.
    let waiter = |conversation: &'static str| {
        let (c, url) = (c.clone(), proxy.url(CHAT));
        tokio::spawn(async move {
            let start = Instant::now();
            let r = c
                .post(url)
                .body(chat("s", conversation, 1, false))
                .send()
                .await
                .unwrap();
            let retry_after = r.headers().get("retry-after").cloned();
            (
                r.status(),
                retry_after,
                start.elapsed(),
                r.text().await.unwrap(),
            )
        })
    };

    // A short holder: the waiter gets the slot once it ends.
    let holder = hold(4).await.unwrap();
    let served = waiter("waiter");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _ = holder.bytes().await.unwrap();
    let (status, _, waited, _) = served.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        waited >= Duration::from_millis(100),
        "served without waiting: {waited:?}"
    );

    // A long holder: one waiter times out, the one behind it finds the line full.
    let holder = hold(40).await.unwrap();
    let timed_out = waiter("w1");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, retry_after, _, body) = waiter("w2").await.unwrap();
    assert_eq!(status, 503);
    assert!(retry_after.is_some());
    let err: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["code"], "cluster_saturated");
    assert_eq!(err["error"]["type"], "server_error");
    assert!(err["error"]["message"].is_string());

    let (status, retry_after, waited, body) = timed_out.await.unwrap();
    assert_eq!(status, 503);
    assert_eq!(retry_after.unwrap(), "1");
    assert!(waited >= Duration::from_millis(380), "{waited:?}");
    let err: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["code"], "queue_timeout");
    drop(holder);
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_length_queue_rejects_at_once() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .balance_factor(None)
        .max_waiting(0);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let holder = c
        .post(proxy.url(CHAT))
        .header("x-mock-events", "20")
        .header("x-mock-interval-ms", "50")
        .body(chat("s", "holder", 1, true))
        .send()
        .await
        .unwrap();
    let start = Instant::now();
    let r = c
        .post(proxy.url(CHAT))
        .body(chat("s", "x", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(start.elapsed() < Duration::from_millis(300));
    drop(holder);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_is_skipped_by_retrying_the_next_one() {
    let live = start_upstream("live").await;
    // An address nobody listens on: connects are refused.
    let (dead, _refusing) = refused_addr();
    let cfg = TestConfig::new()
        .peers_at([dead, live.addr])
        .connect_retries(1)
        .peek_limit_bytes(150000)
        .no_health_check()
        .consecutive_failures(0);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    for i in 0..40 {
        let r = post_chat(
            &c,
            &proxy,
            chat("s", &format!("conversation {i}"), 1, false),
        )
        .await;
        assert_eq!(r.status(), 200, "{}", proxy.log());
        assert_eq!(upstream_of(&r), "live");
    }
    assert_eq!(
        live.seen().len(),
        40,
        "every request reached the live peer exactly once"
    );
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_stop_at_the_configured_count() {
    let refusing: Vec<_> = (0..3).map(|_| refused_addr()).collect();
    let cfg = TestConfig::new()
        .peers_at(refusing.iter().map(|(a, _)| *a))
        .connect_retries(1);
    let proxy = start_proxy(&cfg).await;
    let r = post_chat(&client(), &proxy, chat("s", "q", 1, false)).await;
    assert_eq!(r.status(), 502);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "upstream_error");
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_for_want_of_a_slot_reaches_a_client_still_sending_its_body() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(0)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let held = open_stream(&proxy, 30, 100).await;
    // A 20 MB prompt: the key is read from its first bytes, the rest is still unsent when the
    // 503 is answered.
    let long = chat(&"long system prompt ".repeat(1_100_000), "q", 1, false);
    for _ in 0..3 {
        let r = c
            .post(proxy.url(CHAT))
            .header("x-session-id", "another")
            .body(long.clone())
            .send()
            .await
            .expect("the 503 must arrive, not a reset");
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["retry-after"], "1");
    }
    drop(held);
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_client_leaves_leaves_the_line_at_once() {
    use tokio::io::AsyncWriteExt;
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(4)
        .queue_timeout_ms(10000)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let held = open_stream(&proxy, 10, 100).await;
    let body = chat("s", "the one who leaves", 1, false);
    let mut leaving = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    leaving
        .write_all(
            format!(
                "POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let waiting = |l: &serde_json::Value| l["waiting"].as_u64().unwrap();
    let start = Instant::now();
    while waiting(&proxy.peers().await) == 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "it never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(leaving);
    let left = Instant::now();
    while waiting(&proxy.peers().await) != 0 {
        assert!(
            left.elapsed() < Duration::from_millis(500),
            "the gone client kept its place"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    held.text().await.unwrap();
    proxy.assert_idle().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        up.seen().len(),
        1,
        "the gone client's request went upstream"
    );
}
