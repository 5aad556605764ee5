//! API keys and tenant limits: unknown clients refused before the body, concurrency and rate
//! caps per key, key reload, and forwarding the key to the engine.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;

fn key_entry(name: &str, key: &str, limits: &str) -> String {
    format!(
        "  - {{name: {name}, sha256: {}{limits}}}\n",
        sha256_hex(key.as_bytes())
    )
}

/// The proxy in front of `up` with API keys from a file of `entries`, `auth` adding settings;
/// the file's path, and the directory that holds it.
async fn keyed_proxy(
    up: &Upstream,
    entries: &[String],
    auth: impl FnOnce(TestConfig) -> TestConfig,
) -> (Proxy, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.yaml");
    put(&keys, &format!("keys:\n{}", entries.concat()));
    let proxy = start_proxy(&auth(TestConfig::new().keys_file(&keys).peers(&[up]))).await;
    (proxy, keys, dir)
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

#[tokio::test]
async fn api_keys_refuse_unknown_clients_before_the_body_and_cap_each_tenant() {
    let up = start_upstream("a").await;
    let entries = [
        key_entry("team-a", "sk-a", ", max_concurrent: 1"),
        key_entry("team-b", "sk-b", ""),
    ];
    let (proxy, keys, _dir) = keyed_proxy(&up, &entries, |c| c).await;
    let post = |key: Option<&str>| {
        let mut req = client()
            .post(proxy.url("/v1/chat/completions"))
            .body(chat("s", "q", 1, false));
        if let Some(key) = key {
            req = req.header("authorization", bearer(key));
        }
        req.send()
    };
    for key in [None, Some("sk-wrong")] {
        let answer = post(key).await.unwrap();
        assert_eq!(answer.status(), 401);
        assert_eq!(answer.headers()["www-authenticate"], "Bearer");
        let json: serde_json::Value = answer.json().await.unwrap();
        assert_eq!(json["error"]["code"], "invalid_api_key");
    }
    // Refused on the headers: the declared body is never waited for.
    let mut raw = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    raw.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n")
        .await
        .unwrap();
    let mut head = vec![0u8; 12];
    tokio::time::timeout(Duration::from_secs(2), raw.read_exact(&mut head))
        .await
        .expect("no answer before the body")
        .unwrap();
    assert_eq!(&head, b"HTTP/1.1 401");
    // And the connection closes at once: nothing more of it is read, not even to drain it.
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_millis(500), raw.read_to_end(&mut rest))
        .await
        .expect("the connection stayed open for the body")
        .unwrap();
    assert!(String::from_utf8_lossy(&rest).contains("invalid_api_key"));
    assert!(up.seen().is_empty());

    // team-a at its cap of one: its next request is refused, team-b's is served.
    let held = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("authorization", bearer("sk-a"))
        .header("x-mock-events", "40")
        .header("x-mock-interval-ms", "50")
        .body(chat("s", "q", 1, true))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let refused = post(Some("sk-a")).await.unwrap();
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    let json: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(json["error"]["code"], "rate_limit_exceeded");
    assert_eq!(post(Some("sk-b")).await.unwrap().status(), 200);
    drop(held);
    proxy.assert_idle().await;
    assert_eq!(post(Some("sk-a")).await.unwrap().status(), 200);

    // The key stays at the edge unless forwarding is on; its name is logged and counted.
    assert!(up
        .seen()
        .iter()
        .all(|s| !s.headers.contains_key("authorization")));
    let log = proxy
        .access_log_when(|l| l.matches("tenant=team-a").count() >= 3 && l.contains("tenant=team-b"))
        .await;
    // team-a's three requests (the refused one too) and team-b's are named.
    assert_eq!(log.matches("tenant=team-a").count(), 3, "{log}");
    assert!(log.contains("tenant=team-b"), "{log}");
    assert!(
        log.lines()
            .any(|l| l.contains(" 429 ") && l.contains("tenant=team-a")),
        "{log}"
    );
    assert!(!log.contains("sk-a"), "{log}");
    let metrics = proxy.metrics().await;
    assert!(
        metrics
            .contains("prefixlb_tenant_requests_total{key=\"team-a\",outcome=\"concurrency\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("prefixlb_tenant_max_concurrent{key=\"team-a\"} 1"));
    assert!(metrics.contains("prefixlb_auth_failures_total{reason=\"missing\"} 2"));

    // A new file: a new key works, a removed one no longer does.
    put(
        &keys,
        &format!("keys:\n{}", key_entry("team-c", "sk-c", "")),
    );
    let start = Instant::now();
    while post(Some("sk-c")).await.unwrap().status() != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "keys not reloaded"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(post(Some("sk-a")).await.unwrap().status(), 401);
    proxy.assert_idle().await;
}

#[tokio::test]
async fn a_key_goes_on_to_the_engine_only_when_forwarding_is_on_and_rates_hold() {
    let up = start_upstream("a").await;
    let entries = [
        key_entry("t", "sk-t", ""),
        key_entry("slow", "sk-slow", ", requests_per_second: 1"),
    ];
    let (proxy, _, _dir) = keyed_proxy(&up, &entries, TestConfig::forward_key).await;
    let answer = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("authorization", bearer("sk-t"))
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(up.seen()[0].headers["authorization"], "Bearer sk-t");

    // One request a second: the second at once is refused, with when to come back.
    let post = || {
        client()
            .post(proxy.url("/v1/chat/completions"))
            .header("authorization", bearer("sk-slow"))
            .body(chat("s", "q", 1, false))
            .send()
    };
    assert_eq!(post().await.unwrap().status(), 200);
    let refused = post().await.unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "1");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(post().await.unwrap().status(), 200);
    assert!(proxy
        .metrics()
        .await
        .contains("prefixlb_tenant_requests_total{key=\"slow\",outcome=\"request_rate\"} 1"));
}
