//! HTTP/1 details and headers: request ids and forwarding headers, paths that are not
//! forwarded, requests that need no slot, HTTP/1.0 clients, pipelining, and heads read in parts.

use std::time::Duration;

use crate::common::*;
use crate::{post_chat, read_to_close, CHAT};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_see_who_asked_and_the_request_id_goes_both_ways() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up]).access_log("plain")).await;
    let c = client();
    let sent = c
        .post(proxy.url(CHAT))
        .header("x-forwarded-for", "203.0.113.9")
        .header("x-forwarded-proto", "https")
        .header("x-request-id", "client-id-1")
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(sent.headers()["x-request-id"], "client-id-1");
    let made = c
        .post(proxy.url(CHAT))
        .header("x-request-id", "not usable: spaces")
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    let made_id = made.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(made_id.len(), 32, "{made_id}");
    let seen = up.seen();
    let h = &seen[0].headers;
    assert_eq!(
        h["x-forwarded-for"], "127.0.0.1",
        "a stranger's chain was kept"
    );
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-request-id"], "client-id-1");
    assert_eq!(seen[1].headers["x-request-id"], made_id.as_str());
    proxy.assert_idle().await;
    let log = proxy.access_log_when(|l| l.lines().count() >= 2).await;
    assert!(log.contains("request_id=client-id-1"), "{log}");
    assert!(log.contains(&format!("request_id={made_id}")), "{log}");

    let trusting = start_proxy(
        &TestConfig::new()
            .peers(&[&up])
            .trusted_proxies(&["127.0.0.0/8"]),
    )
    .await;
    c.post(trusting.url(CHAT))
        .header("x-forwarded-for", "203.0.113.9")
        .header("x-forwarded-proto", "https")
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    let h = &up.seen()[2].headers;
    assert_eq!(h["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "https");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_own_controls_are_not_reachable_through_the_balancer() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let c = client();
    for path in [
        "/start_profile",
        "/reset_prefix_cache",
        "/v1/load_lora_adapter",
        "/metrics",
    ] {
        let r = c
            .post(proxy.url(path))
            .header("x-request-id", "refused-1")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{path}");
        assert_eq!(
            r.headers()["x-request-id"],
            "refused-1",
            "an answer of prefixlb's own without the request id"
        );
        let err: serde_json::Value = r.json().await.unwrap();
        assert_eq!(err["error"]["code"], "unknown_url", "{path}");
    }
    assert!(up.seen().is_empty(), "{:?}", up.seen());
    let r = c.get(proxy.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let open = start_proxy(&TestConfig::new().peers(&[&up]).forward_every_path()).await;
    let r = c
        .post(open.url("/start_profile"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "allowed_paths: null forwards every path");
}

/// A model list or a health probe is not a prompt: it neither waits for nor is refused a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_list_is_answered_while_every_slot_is_taken() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(0)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let held = open_stream(&proxy, 30, 100).await;
    let c = client();
    let prompt = post_chat(&c, &proxy, chat("s", "q", 1, false)).await;
    assert_eq!(prompt.status(), 503, "the cluster is not full");
    let r = c.get(proxy.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    drop(held);
    proxy.assert_idle().await;
}

/// Everything the proxy sends on one connection after `request` is written, until it closes
/// (or 5 s pass).
async fn raw_exchange(proxy: &Proxy, request: &[u8]) -> String {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(request).await.unwrap();
    read_to_close(&mut s).await
}

/// A 1.0 client cannot read chunked framing: a stream of unknown length reaches it delimited
/// by the close, as HTTP/1.0 has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_client_gets_its_stream_close_delimited() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let body = chat("s", "an old client", 1, true);
    let request = format!(
        "POST {CHAT} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nx-mock-events: 3\r\nx-mock-interval-ms: 20\r\n\r\n{body}",
        body.len()
    );
    let got = raw_exchange(&proxy, request.as_bytes()).await;
    let (head, rest) = got.split_once("\r\n\r\n").expect("a whole head");
    let head = head.to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.0 200") || head.starts_with("http/1.1 200"),
        "{got}"
    );
    assert!(
        !head.contains("transfer-encoding"),
        "chunked to a 1.0 client: {got}"
    );
    assert!(!head.contains("keep-alive"), "{got}");
    assert!(
        rest.starts_with("data: {\"i\":0"),
        "framing in the body: {got:?}"
    );
    assert!(rest.ends_with("data: [DONE]\n\n"), "{got:?}");
    proxy.assert_idle().await;
}

/// Requests sent back to back on one connection, before any answer is read, are each answered,
/// in order (RFC 9112 §9.3.2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let up = start_upstream("a").await;
    // One slot, taken for a while: the first request waits in line while the others are
    // already in the proxy's read buffer, which watching for the client's close must not eat.
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(4)
        .queue_timeout_ms(10000)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let held = open_stream(&proxy, 5, 100).await;
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(held);
    });
    let bodies: Vec<String> = (0..3)
        .map(|i| chat("s", &format!("pipelined {i}"), 1, false))
        .collect();
    let requests: String = bodies
        .iter()
        .enumerate()
        .map(|(i, body)| {
            let last = if i == bodies.len() - 1 { "Connection: close\r\n" } else { "" };
            format!(
                "POST {CHAT} HTTP/1.1\r\nHost: x\r\n{last}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
        })
        .collect();
    let got = raw_exchange(&proxy, requests.as_bytes()).await;
    assert_answered_in_order(&got, &bodies);
    release.await.unwrap();
    proxy.assert_idle().await;
}

/// A kept-alive connection's next request is read from what has come when it wakes: a head
/// that comes in pieces, and one longer than that first read takes (4 KiB), are read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_pieces_or_past_the_first_read_is_read_whole() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up]).no_health_check()).await;
    let bodies: Vec<String> = (0..3)
        .map(|i| chat("s", &format!("read whole {i}"), 1, false))
        .collect();
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let mut got = String::new();
    for (i, body) in bodies.iter().enumerate() {
        let extra = match i {
            1 => format!("x-padding: {}\r\n", "p".repeat(6000)),
            2 => "Connection: close\r\n".to_owned(),
            _ => String::new(),
        };
        let request = format!(
            "POST {CHAT} HTTP/1.1\r\nHost: x\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        // The long head at once; the others a few bytes first, the rest a moment later.
        let pieces = match i {
            1 => request.as_bytes().split_at(request.len()),
            _ => request.as_bytes().split_at(5),
        };
        s.write_all(pieces.0).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        s.write_all(pieces.1).await.unwrap();
        if i == bodies.len() - 1 {
            got.push_str(&read_to_close(&mut s).await);
            break;
        }
        // This answer (the mock's digest of the body) before the next request goes.
        let digest = sha256_hex(body.as_bytes());
        let mut buf = [0u8; 8192];
        tokio::time::timeout(Duration::from_secs(5), async {
            while !got.contains(&digest) {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before answering request {i}: {got}");
                got.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no answer to request {i}: {got}"));
    }
    assert_answered_in_order(&got, &bodies);
    proxy.assert_idle().await;
}
