//! HTTP/2 from clients: a body replayed to the next peer, a reset stream, and h2c by prior
//! knowledge beside HTTP/1.1 on one port.

use std::time::{Duration, Instant};

use http_body_util::BodyExt;

use crate::common::*;
use crate::{events_in, frames, stream_headers, tls_test_listener, Conn};

#[tokio::test]
async fn an_http2_body_is_replayed_intact_to_the_next_peer_after_a_failed_connect() {
    let up = start_upstream("a").await;
    // A peer nothing listens on: every request whose key lands there is retried on `a`.
    let (dead, _refusing) = refused_addr();
    let (pki, _certs, listen) = tls_test_listener();
    let proxy = start_proxy(
        &listen
            .peers_at([dead, up.addr])
            .no_health_check()
            .consecutive_failures(0),
    )
    .await;
    let (mut conn, alpn) = Conn::open(proxy.addr, &pki.ca_pem(), true).await.unwrap();
    assert_eq!(alpn, b"h2");
    // 16 conversations: all keys miss the dead peer's half of the ring once in 65,536 runs.
    for i in 0..16 {
        let body = chat(&format!("{i} {}", "s".repeat(70 * 1024)), "q", 1, false);
        let answer = conn.post("/v1/chat/completions", &[], body.clone()).await;
        assert_eq!(answer.status(), 200, "conversation {i}");
        let bytes = answer.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            json["sha256"],
            sha256_hex(body.as_bytes()),
            "conversation {i}"
        );
    }
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains(&format!(
            "prefixlb_peer_connect_failures_total{{peer=\"{dead}\"}}"
        )),
        "no request was retried: {metrics}"
    );
    proxy.assert_idle().await;
}

#[tokio::test]
async fn a_reset_http2_stream_frees_its_slot_and_leaves_the_connection_up() {
    let up = start_upstream("a").await;
    let (pki, _certs, listen) = tls_test_listener();
    let proxy = start_proxy(&listen.peers(&[&up])).await;
    let (mut conn, alpn) = Conn::open(proxy.addr, &pki.ca_pem(), true).await.unwrap();
    assert_eq!(alpn, b"h2");
    let answer = conn
        .post(
            "/v1/chat/completions",
            &stream_headers(400, 50),
            chat("s", "q", 1, true),
        )
        .await;
    let mut body = answer.into_body();
    body.frame().await.unwrap().unwrap();
    assert_eq!(proxy.in_flight_of(&up.addr_str()).await, 1);
    // Dropping the body resets the stream (RST_STREAM); the connection stays open.
    drop(body);
    let start = Instant::now();
    while proxy.in_flight_of(&up.addr_str()).await > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "the reset stream still holds its slot"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let again = conn
        .post("/v1/chat/completions", &[], chat("s", "q", 1, false))
        .await;
    assert_eq!(again.status(), 200);
    proxy.assert_idle().await;
    // The client left: no engine's stream broke.
    let metrics = proxy.metrics().await;
    assert_eq!(
        sample(&metrics, "prefixlb_stream_errors_total{reason=\"broken\"}"),
        0.0,
        "{metrics}"
    );
}

#[tokio::test]
async fn h2c_serves_http2_by_prior_knowledge_and_http1_on_the_same_port() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().h2c().peers(&[&up]).max_in_flight(1)).await;
    let mut conn = Conn::open_h2c(proxy.addr).await;
    // Stream A takes the only slot; stream B waits in line on the same connection, and is
    // served once A ends (a waiting HTTP/2 stream is not taken for a client gone).
    let held = conn
        .post(
            "/v1/chat/completions",
            &stream_headers(6, 50),
            chat("s", "q", 1, true),
        )
        .await;
    assert_eq!(held.status(), 200);
    let mut second = Conn::H2(match &conn {
        Conn::H2(send) => send.clone(),
        Conn::H1(_) => unreachable!(),
    });
    let waiting = tokio::spawn(async move {
        let answer = second
            .post("/v1/chat/completions", &[], chat("s", "q", 1, false))
            .await;
        answer.status()
    });
    let start = Instant::now();
    while proxy.peers().await["waiting"] != 1 {
        assert!(start.elapsed() < Duration::from_secs(5), "nobody waits");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(events_in(&frames(held.into_body()).await), 6);
    assert_eq!(waiting.await.unwrap(), 200);
    let plain = client()
        .post(proxy.url("/v1/chat/completions"))
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(plain.status(), 200);
    assert_eq!(plain.version(), reqwest::Version::HTTP_11);
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_cut_upstream_ends_whole_with_the_error_event() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().h2c().peers(&[&up])).await;
    let mut conn = Conn::open_h2c(proxy.addr).await;
    let mut headers = stream_headers(10, 20);
    headers.push(("x-mock-reset-after", "2".to_string()));
    let answer = conn
        .post("/v1/chat/completions", &headers, chat("s", "q", 1, true))
        .await;
    assert_eq!(answer.status(), 200);
    let mut body = answer.into_body();
    let mut text = String::new();
    let end = loop {
        match body.frame().await {
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    text.push_str(&String::from_utf8_lossy(&data));
                }
            }
            Some(Err(e)) => break Err(e),
            None => break Ok(()),
        }
    };
    // No reset: it would discard the event queued before it, and the connection stays up.
    assert!(end.is_ok(), "the stream was reset: {end:?}, {text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
    assert!(
        last.starts_with("data: {\"error\"") && last.contains("upstream_error"),
        "{text}"
    );
    // The connection serves the next stream.
    let next = conn
        .post("/v1/chat/completions", &[], chat("s", "q", 1, false))
        .await;
    assert_eq!(next.status(), 200);
    proxy.assert_idle().await;
}
