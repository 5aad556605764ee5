//! Stopping: as soon as the work is done, bounded by the grace period; at once on a second
//! signal; never from a signal that came too early or an upgrade nobody takes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;

/// The shipped grace period: a stop must not wait it out.
fn shipped_grace() -> PingoraConfig {
    PingoraConfig::new().grace_seconds(300, 10)
}

async fn proxy_for(up: &Upstream) -> Proxy {
    start_proxy_with(
        &TestConfig::new().peers(&[up]).no_health_check(),
        &shipped_grace(),
    )
    .await
}

/// Starts a stream of `events` SSE events `interval_ms` apart; returns a task that reads it to
/// the end and tells whether it ended with `[DONE]`.
async fn stream(proxy: &Proxy, events: u32, interval_ms: u32) -> tokio::task::JoinHandle<bool> {
    let r = open_stream(proxy, events, interval_ms).await;
    assert_eq!(r.status(), 200);
    tokio::spawn(async move {
        let mut body = r.bytes_stream();
        let mut text = Vec::new();
        while let Some(Ok(chunk)) = body.next().await {
            text.extend_from_slice(&chunk);
        }
        text.ends_with(b"data: [DONE]\n\n")
    })
}

/// Whether a short request through the proxy gets a 200.
async fn answers(proxy: &Proxy) -> bool {
    let r = client()
        .post(proxy.url("/v1/completions"))
        .body(r#"{"prompt":"x"}"#)
        .send()
        .await;
    r.is_ok_and(|r| r.status() == 200)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_stop_takes_under_two_seconds() {
    let up = start_upstream("a").await;
    let mut proxy = proxy_for(&up).await;
    let start = Instant::now();
    proxy.signal("TERM");
    let took = proxy.exits(Duration::from_secs(5)).await - start;
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert!(proxy.log().contains("drained"), "{}", proxy.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_waits_for_the_stream_in_flight_and_no_longer() {
    let up = start_upstream("a").await;
    let mut proxy = proxy_for(&up).await;
    let started = Instant::now();
    let done = stream(&proxy, 30, 100).await;
    proxy.signal("TERM");
    let exited = proxy.exits(Duration::from_secs(10)).await - started;
    assert!(done.await.unwrap(), "the stream was cut");
    assert!(
        exited > Duration::from_millis(2900) && exited < Duration::from_millis(4200),
        "exited {exited:?} after a 3 s stream began"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_during_the_drain_stops_at_once() {
    let up = start_upstream("a").await;
    for second in ["TERM", "INT"] {
        let mut proxy = proxy_for(&up).await;
        let done = stream(&proxy, 100, 100).await;
        proxy.signal("TERM");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(proxy.running(), "the drain waits for the stream");
        let start = Instant::now();
        proxy.signal(second);
        let took = proxy.exits(Duration::from_secs(3)).await - start;
        assert!(took < Duration::from_secs(1), "{second}: took {took:?}");
        assert!(!done.await.unwrap(), "a 10 s stream cannot have ended");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_in_the_first_moments_do_not_end_the_process() {
    let up = start_upstream("a").await;
    let mut proxy = spawn_proxy(
        &TestConfig::new().peers(&[&up]).no_health_check(),
        &shipped_grace(),
    );
    // While it starts (its first log line comes right after its handlers are in place, well
    // before it serves): reloads are moot, an upgrade has no successor.
    let start = Instant::now();
    while proxy.log().is_empty() {
        assert!(start.elapsed() < Duration::from_secs(10), "nothing logged");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for _ in 0..3 {
        proxy.signal("HUP");
        proxy.signal("QUIT");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.wait_ready().await;
    assert!(answers(&proxy).await);
    assert!(proxy.running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_that_nobody_takes_leaves_the_process_serving() {
    let up = start_upstream("a").await;
    let proxy = proxy_for(&up).await;
    // A successor that fails in start-up: it never listens on the upgrade socket.
    let broken = proxy.dir.path().join("broken.yaml");
    std::fs::write(&broken, "routing: {balance_factor: 0.5}\n").unwrap();
    let status = std::process::Command::new(binary())
        .arg("-l")
        .arg(&broken)
        .arg("-c")
        .arg(proxy.dir.path().join("pingora.yaml"))
        .arg("-u")
        .status()
        .unwrap();
    assert!(!status.success());
    proxy.signal("QUIT");
    // Past Pingora's 5 s hand-over and more: still accepting, still serving.
    tokio::time::sleep(Duration::from_secs(7)).await;
    assert!(answers(&proxy).await);
    assert!(
        proxy.log().contains("no new process waits"),
        "{}",
        proxy.log()
    );
}
