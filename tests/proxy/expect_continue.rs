//! `Expect: 100-continue`: when the 100 is sent, and what comes after it.

use std::time::Duration;

use crate::common::*;
use crate::{read_to_close, CHAT};

/// What a client that sends `Expect: 100-continue` sees: what the proxy answers before the body
/// is sent (the head of a 100, or of a final answer), then, once the body is sent, the rest up
/// to the close.
async fn continue_exchange(proxy: &Proxy, headers: &str, body: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n{headers}\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut first = Vec::new();
    let mut buf = [0u8; 4096];
    let interim = tokio::time::timeout(Duration::from_secs(3), async {
        while !String::from_utf8_lossy(&first).contains("\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before any answer");
            first.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    assert!(
        interim.is_ok(),
        "no answer while the proxy waits for the body"
    );
    // A proxy that has answered may have closed already: the body is then not wanted.
    let _ = s.write_all(body.as_bytes()).await;
    (
        String::from_utf8_lossy(&first).into_owned(),
        read_to_close(&mut s).await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered_before_the_body_is_read() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let body = chat("s", "a client that waits for 100 Continue", 1, false);
    let (interim, rest) = continue_exchange(&proxy, "", &body).await;
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim}");
    assert!(rest.starts_with("HTTP/1.1 200"), "{rest}");
    assert!(rest.contains(&sha256_hex(body.as_bytes())), "{rest}");
}

/// Once the 100 is out, an error later on is still answered, and logged, as itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_failure_after_100_continue_is_answered_502() {
    let (dead, _refusing) = refused_addr();
    let cfg = TestConfig::new()
        .peers_at([dead])
        .connect_retries(0)
        .no_health_check()
        .access_log("json");
    let proxy = start_proxy(&cfg).await;
    let (interim, rest) = continue_exchange(&proxy, "", &chat("s", "q", 1, false)).await;
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim}");
    assert!(
        rest.starts_with("HTTP/1.1 502"),
        "a bare close after the 100: {rest:?}"
    );
    assert!(rest.contains("upstream_error"), "{rest}");
    proxy.assert_idle().await;
    let logged = proxy.access_log_when(|l| l.contains("\"status\"")).await;
    assert!(logged.contains("\"status\":502"), "{logged}");
    proxy.assert_idle().await;
}

/// A key the headers give is admitted before the client is told to send its body: a full
/// cluster answers 503 at once, and a free one lets the engine answer the 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_key_is_admitted_before_100_continue() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(0)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let body = chat("s", "a large upload", 1, false);
    let held = open_stream(&proxy, 30, 100).await;
    let (first, _) = continue_exchange(&proxy, "x-session-id: s1\r\n", &body).await;
    assert!(first.starts_with("HTTP/1.1 503"), "{first}");
    drop(held);
    proxy.assert_idle().await;
    let (interim, rest) = continue_exchange(&proxy, "x-session-id: s1\r\n", &body).await;
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim}");
    assert!(rest.starts_with("HTTP/1.1 200"), "{rest}");
    assert!(rest.contains(&sha256_hex(body.as_bytes())), "{rest}");
}
