//! Bad input: oversized, malformed, ambiguously framed or trickling requests, and invalid
//! configurations.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::{framed, sized_body, Framing, CHAT};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_413() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new().peers(&[&up]).max_body_bytes(100000);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let big = sized_body(200_000);
    for (path, framing) in [
        (CHAT, Framing::Length),
        (CHAT, Framing::Chunked(8192)),
        ("/v1/embeddings", Framing::Length),
        ("/v1/embeddings", Framing::Chunked(8192)),
    ] {
        let r = c
            .post(proxy.url(path))
            .body(framed(big.clone(), &framing))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 413, "{path}");
        let err: serde_json::Value = r.json().await.unwrap();
        assert_eq!(err["error"]["type"], "invalid_request_error");
        assert_eq!(err["error"]["code"], "request_too_large");
    }
    let ok = c
        .post(proxy.url(CHAT))
        .body(sized_body(90_000))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_are_routed_by_fallback_and_leak_nothing() {
    let ups = upstreams::<2>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let bodies: Vec<Vec<u8>> = vec![
        b"not json at all".to_vec(),
        b"{\"messages\": [".to_vec(),
        vec![0xff, 0xfe, 0x00, 0x7b],
        format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000)).into_bytes(),
        br#"{"messages":"wrong shape"}"#.to_vec(),
    ];
    let mut by_body: HashMap<usize, String> = HashMap::new();
    for (i, b) in bodies.iter().enumerate() {
        let r = c
            .post(proxy.url(CHAT))
            .body(b.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let echo: serde_json::Value = r.json().await.unwrap();
        assert_eq!(echo["sha256"], sha256_hex(b).as_str());
        by_body.insert(i, echo["upstream"].as_str().unwrap().to_owned());
    }
    // Fallback is the client address: one client, one peer.
    assert_eq!(by_body.values().collect::<HashSet<_>>().len(), 1);
    proxy.assert_idle().await;
}

/// A key path renamed in the configuration is forwarded, whatever the allowlist says.
#[test]
fn renamed_key_paths_are_allowed() {
    let settings = prefixlb::config::parse(
        "peers: [{addr: \"127.0.0.1:1\"}]\nrouting: {key: {chat_path: /my/chat}}\n",
    )
    .unwrap();
    let allowed = settings.proxy.forwarding.allowed_paths.unwrap();
    assert!(allowed.iter().any(|p| p == "/my/chat"), "{allowed:?}");
}

#[test]
fn invalid_configs_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "peers: [{addr: \"127.0.0.1:1\", wieght: 2}]",
            "peers[0].wieght",
        ),
        ("routing: {balance_factor: 0.5}", "routing.balance_factor"),
        ("peers: [{addr: \"not an address\"}]", "peers[0].addr"),
        ("queue: {max_waiting: -1}", "queue.max_waiting"),
        ("listen: [\"127.0.0.1:99999\"]", "listen[0]"),
        ("admin: {listen: \"0.0.0.0:9090\"}", "admin.listen"),
        (
            "peers: [{addr: \"127.0.0.1:1\"}, {addr: \"127.0.0.1:2\", weight: 0}]",
            "peers[1].weight",
        ),
        (
            "forwarding: {request_id_header: content-length}",
            "forwarding.request_id_header",
        ),
        (
            "forwarding: {trusted_proxies: [10.0.0.0/33]}",
            "forwarding.trusted_proxies[0]",
        ),
        (
            "limits: {peek_memory_bytes: 1000}",
            "limits.peek_memory_bytes",
        ),
        (
            "listen: [{addr: \"127.0.0.1:8443\", tls: {cert: /no/cert.pem, key: /no/key.pem}}]",
            "listen[0].tls.cert",
        ),
        ("auth: {keys_file: /no/keys.yaml}", "auth.keys_file"),
        (
            "replicas: {listen: \"127.0.0.1:7300\", others: []}",
            "replicas.others",
        ),
        (
            "replicas: {listen: \"127.0.0.1:7300\", others: [\"10.0.0.2\"]}",
            "replicas.others[0]",
        ),
        ("peers: [{addr: \"127.0.0.1:1\", sni: x}]", "peers[0].sni"),
        (
            "listen: [\"0.0.0.0:8080\", \"127.0.0.1:8080\"]",
            "listen[1]",
        ),
        ("listen: [\"127.0.0.1:9090\"]", "admin.listen"),
        ("access_log: {hash_secret: \"\"}", "access_log.hash_secret"),
        ("discovery: {dns: {name: x, port: 0}}", "discovery.dns.port"),
        (
            "advanced: {vnodes_per_weight: 100000000}",
            "advanced.vnodes_per_weight",
        ),
        (
            "discovery: {redis: {url: \"http://x\"}}",
            "discovery.redis.url",
        ),
        (
            "discovery: {redis: {url: \"redis://127.0.0.1:1\"}, dns: {name: x, port: 1}}",
            "discovery",
        ),
        // `-t` asks the registry, which does not answer on port 1.
        (
            "discovery: {redis: {url: \"redis://127.0.0.1:1\"}}",
            "discovery.redis",
        ),
    ]
    .map(|(yaml, field)| (yaml.to_owned(), field));
    // Files that exist but hold no certificate, no CA, or a bad key entry.
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not PEM at all").unwrap();
    let keys = dir.path().join("keys.yaml");
    std::fs::write(&keys, "keys: [{name: a, sha256: abc}]").unwrap();
    let (junk, keys) = (junk.display(), keys.display());
    let files = [
        (
            format!("listen: [{{addr: \"127.0.0.1:8443\", tls: {{cert: \"{junk}\", key: \"{junk}\"}}}}]"),
            "tls.cert",
        ),
        (
            format!("upstream: {{tls: {{ca_file: \"{junk}\"}}}}"),
            "upstream.tls.ca_file",
        ),
        (format!("auth: {{keys_file: \"{keys}\"}}"), "keys[0]"),
    ];
    for (yaml, field) in cases.into_iter().chain(files) {
        let path = dir.path().join("bad.yaml");
        std::fs::write(&path, &yaml).unwrap();
        let out = std::process::Command::new(binary())
            .arg("-l")
            .arg(&path)
            .arg("-t")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{yaml} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(field), "{yaml}: {stderr}");
    }
    let ok = std::process::Command::new(binary())
        .args(["-l", "conf/prefixlb.yaml", "-c", "conf/pingora.yaml", "-t"])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
}

/// Sends `head` (a request line and headers, without the blank line) and `body` on a raw
/// connection; returns the response's status code.
async fn raw_status(proxy: &Proxy, head: &str, body: &[u8]) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(format!("{head}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    // The answer may come before the whole body is taken: a refused write is fine.
    let _ = s.write_all(body).await;
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    while !response.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => response.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&response);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_content_length_is_a_length() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_body_bytes(100000)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let head = |n: usize| format!("POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: {n}, {n}");
    let big = sized_body(150_000);
    assert_eq!(raw_status(&proxy, &head(big.len()), &big).await, 413);
    let fits = sized_body(90_000);
    assert_eq!(raw_status(&proxy, &head(fits.len()), &fits).await, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].sha256,
        sha256_hex(&fits),
        "the body went upstream changed"
    );
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_trickles_in_gets_408_at_the_peek_deadline() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .peek_timeout_ms(500)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let start = Instant::now();
    // Ten bytes of a thousand, then nothing: each read waits far less than Pingora's 60 s.
    let head = format!("POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: 1000");
    assert_eq!(raw_status(&proxy, &head, b"{\"messages").await, 408);
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert!(up.seen().is_empty(), "a body that never came went upstream");
    proxy.assert_idle().await;
}

/// A head sent a line at a time, each well within Pingora's 60 s a read: 408 at the head
/// timeout, in OpenAI's error form, and the connection closed; a head in pieces that ends in
/// time is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_trickles_in_gets_408_at_the_head_timeout() {
    trickled_heads_get_408(false).await;
}

/// With h2c on, a plain connection's first bytes are looked at for HTTP/2's preface within the
/// same limits: HTTP/1 heads get the same 408, and a request shorter than the preface is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_h2c_a_trickled_head_gets_408_and_a_short_request_is_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (proxy, _up) = trickled_heads_get_408(true).await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    // 22 bytes, fewer than the preface's 24.
    s.write_all(b"GET /ping HTTP/1.0\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "no answer to a short HTTP/1.0 request");
    assert!(
        answer.starts_with(b"HTTP/1."),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );

    // A first byte that could begin the preface, then the rest of an HTTP/1 request: served;
    // then the same byte and silence: 408 at the head timeout, as for any head.
    let body = chat("s", "after a P", 1, false);
    let request = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    for rest in [Some(&request[1..]), None] {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let start = Instant::now();
        s.write_all(b"P").await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        if let Some(rest) = rest {
            s.write_all(rest.as_bytes()).await.unwrap();
        }
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(3), s.read_to_end(&mut answer)).await;
        let text = String::from_utf8_lossy(&answer);
        let want = if rest.is_some() {
            "HTTP/1.1 200 "
        } else {
            "HTTP/1.1 408 "
        };
        assert!(text.starts_with(want), "{want}: {text}");
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }
}

/// Heads sent a line at a time get a 408 at the head timeout; one in two pieces in time is
/// served. The proxy, with `h2c` as asked, and its upstream.
async fn trickled_heads_get_408(h2c: bool) -> (Proxy, Upstream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = start_upstream("a").await;
    let mut cfg = TestConfig::new()
        .peers(&[&up])
        .client_header_timeout_ms(600)
        .no_health_check();
    if h2c {
        cfg = cfg.h2c();
    }
    let proxy = start_proxy(&cfg).await;

    // Straight away, and after empty lines (which Pingora skips before a request line).
    for (round, before) in ["", "\r\n\r\n"].into_iter().enumerate() {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let start = Instant::now();
        s.write_all(format!("{before}POST {CHAT} HTTP/1.1\r\n").as_bytes())
            .await
            .unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        for i in 0..40 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if s.write_all(format!("x-line-{i}: y\r\n").as_bytes())
                .await
                .is_err()
            {
                break;
            }
            match tokio::time::timeout(Duration::from_millis(1), s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(n)) => answer.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
        // Then to the close: the answer, and nothing after it.
        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await {
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
        }
        let elapsed = start.elapsed();
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 408 "), "{before:?}: {text}");
        let body: serde_json::Value =
            serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap();
        assert_eq!(body["error"]["code"], "request_timeout");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(
            elapsed >= Duration::from_millis(550) && elapsed < Duration::from_secs(3),
            "{before:?}: {elapsed:?}"
        );
        assert!(
            up.seen().is_empty(),
            "a head that never ended went upstream"
        );
        let counted = format!(
            "prefixlb_rejections_total{{reason=\"header_timeout\"}} {}",
            round + 1
        );
        assert!(proxy.metrics().await.contains(&counted), "{counted}");
    }

    // In pieces, ending in time: served.
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let body = chat("s", "in pieces", 1, false);
    let request = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let (a, rest) = request.as_bytes().split_at(20);
    s.write_all(a).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    s.write_all(rest).await.unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await.unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 200 "));
    proxy.assert_idle().await;
    (proxy, up)
}
