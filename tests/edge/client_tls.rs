//! TLS from clients: HTTP/1.1 and HTTP/2 by ALPN on one listener, streams and large bodies,
//! and HTTP/1.1 requests that arrive back to back in one TLS record.

use std::time::Duration;

use http_body_util::BodyExt;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;
use crate::{events_in, frames, stream_headers, tls_test_listener, Conn};

#[tokio::test]
async fn tls_listener_serves_http1_and_http2_with_streams_and_large_bodies() {
    let up = start_upstream("a").await;
    let (pki, _certs, listen) = tls_test_listener();
    let proxy = start_proxy(&listen.peers(&[&up])).await;
    let large = chat(&"s".repeat(70 * 1024), "q", 1, false);
    for h2 in [false, true] {
        let (mut conn, alpn) = Conn::open(proxy.addr, &pki.ca_pem(), h2).await.unwrap();
        assert_eq!(alpn, if h2 { &b"h2"[..] } else { b"http/1.1" });
        let answer = conn.post("/v1/chat/completions", &[], large.clone()).await;
        assert_eq!(answer.status(), 200);
        let body = answer.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["sha256"], sha256_hex(large.as_bytes()), "h2={h2}");

        let answer = conn
            .post(
                "/v1/chat/completions",
                &stream_headers(5, 60),
                chat("s", "q", 1, true),
            )
            .await;
        assert_eq!(answer.status(), 200);
        let got = frames(answer.into_body()).await;
        assert_eq!(events_in(&got), 5, "h2={h2}");
        // Events come as the engine sends them, not gathered at the end.
        let first_event = got
            .iter()
            .find(|(_, b)| b.windows(7).any(|w| w == b"data: {"))
            .unwrap()
            .0;
        let span = got.last().unwrap().0 - first_event;
        assert!(span >= Duration::from_millis(200), "h2={h2}: {span:?}");
    }
    // Each stream of the HTTP/2 connection is a request of its own.
    let log = proxy
        .access_log_when(|l| l.lines().filter(|l| l.contains(" 200 ")).count() >= 4)
        .await;
    assert_eq!(
        log.lines().filter(|l| l.contains(" 200 ")).count(),
        4,
        "{log}"
    );
    assert_eq!(up.seen().len(), 4);
    proxy.assert_idle().await;
}

/// Over TLS without ALPN (HTTP/1.1), a connection waits for its next request outside Pingora;
/// requests written back to back arrive in one TLS record, so all but the first are held by
/// rustls, not the socket: each is still answered, in order, and a later one after a pause.
#[tokio::test]
async fn tls_requests_back_to_back_and_after_a_pause_are_answered_in_order() {
    let up = start_upstream("a").await;
    let (pki, _certs, listen) = tls_test_listener();
    let proxy = start_proxy(&listen.peers(&[&up]).no_health_check()).await;
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let mut tls = tls_connector(&pki.ca_pem(), &[])
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .unwrap();
    let bodies: Vec<String> = (0..4)
        .map(|i| chat("s", &format!("back to back {i}"), 1, false))
        .collect();
    let request = |body: &str, last: bool| {
        let close = if last { "Connection: close\r\n" } else { "" };
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{close}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let three: String = bodies[..3].iter().map(|b| request(b, false)).collect();
    tls.write_all(three.as_bytes()).await.unwrap();
    // The three answered before the fourth is sent: the connection then sits idle.
    let mut got = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    while String::from_utf8_lossy(&got)
        .matches("HTTP/1.1 200")
        .count()
        < 3
    {
        let n = tokio::time::timeout(Duration::from_secs(10), tls.read(&mut buf))
            .await
            .expect("three answers in time")
            .unwrap();
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    tls.write_all(request(&bodies[3], true).as_bytes())
        .await
        .unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut got)).await;
    let got = String::from_utf8_lossy(&got);
    assert_answered_in_order(&got, &bodies);
    proxy.assert_idle().await;
}
