//! The edge: TLS and HTTP/2 from clients, TLS to engines, API keys and tenant limits, each
//! through the real binary on loopback, with certificates made here.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::*;

/// A leaf of `pki` in `dir`, and a configuration with a listener that serves it on the proxy's
/// port.
fn tls_listener(dir: &Path, pki: &Pki) -> (PathBuf, PathBuf, TestConfig) {
    let (cert, key) = pki.leaf();
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    put(&cert_path, &cert);
    put(&key_path, &key);
    let config = TestConfig::new().listen_tls(&cert_path, &key_path);
    (cert_path, key_path, config)
}

/// A CA of the test's own, a leaf of it in a scratch directory (kept while the test runs), and
/// a configuration that serves the leaf.
fn tls_test_listener() -> (Pki, tempfile::TempDir, TestConfig) {
    let pki = Pki::new("test ca");
    let certs = tempfile::tempdir().unwrap();
    let (_, _, listen) = tls_listener(certs.path(), &pki);
    (pki, certs, listen)
}

/// One client connection over TLS, HTTP/1.1 or HTTP/2 as ALPN chose.
enum Conn {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Conn {
    /// Connects offering `h2` (and HTTP/1.1) or HTTP/1.1 alone.
    async fn open(addr: SocketAddr, ca_pem: &str, h2: bool) -> std::io::Result<(Conn, Vec<u8>)> {
        let alpn: &[&[u8]] = if h2 {
            &[b"h2", b"http/1.1"]
        } else {
            &[b"http/1.1"]
        };
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let tls = tls_connector(ca_pem, alpn)
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await?;
        let chosen = tls.get_ref().1.alpn_protocol().unwrap_or_default().to_vec();
        let io = TokioIo::new(tls);
        let conn = if chosen == b"h2" {
            let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .unwrap();
            tokio::spawn(conn);
            Conn::H2(send)
        } else {
            let (send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
            tokio::spawn(conn);
            Conn::H1(send)
        };
        Ok((conn, chosen))
    }

    /// HTTP/2 without TLS, by prior knowledge.
    async fn open_h2c(addr: SocketAddr) -> Conn {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(conn);
        Conn::H2(send)
    }

    async fn post(
        &mut self,
        path: &str,
        headers: &[(&str, String)],
        body: String,
    ) -> hyper::Response<Incoming> {
        let mut req = hyper::Request::post(match self {
            Conn::H1(_) => path.to_owned(),
            Conn::H2(_) => format!("https://localhost{path}"),
        })
        .header("content-type", "application/json");
        if let Conn::H1(_) = self {
            req = req.header("host", "localhost");
        }
        for (name, value) in headers {
            req = req.header(*name, value);
        }
        let req = req.body(Full::new(Bytes::from(body))).unwrap();
        match self {
            Conn::H1(s) => s.send_request(req).await.unwrap(),
            Conn::H2(s) => s.send_request(req).await.unwrap(),
        }
    }
}

fn stream_headers(events: u32, interval_ms: u32) -> Vec<(&'static str, String)> {
    vec![
        ("x-mock-events", events.to_string()),
        ("x-mock-interval-ms", interval_ms.to_string()),
    ]
}

/// The body's data frames, each with when it came.
async fn frames(mut body: Incoming) -> Vec<(Instant, Bytes)> {
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            out.push((Instant::now(), data));
        }
    }
    out
}

fn events_in(frames: &[(Instant, Bytes)]) -> usize {
    frames
        .iter()
        .map(|(_, b)| String::from_utf8_lossy(b).matches("data: {").count())
        .sum()
}

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

#[tokio::test]
async fn a_swapped_certificate_serves_new_handshakes_without_dropping_an_open_stream() {
    let up = start_upstream("a").await;
    let (old, new) = (Pki::new("old ca"), Pki::new("new ca"));
    let certs = tempfile::tempdir().unwrap();
    let (cert_path, key_path, listen) = tls_listener(certs.path(), &old);
    let proxy = start_proxy(&listen.peers(&[&up])).await;
    let (mut conn, _) = Conn::open(proxy.addr, &old.ca_pem(), false).await.unwrap();
    let answer = conn
        .post(
            "/v1/chat/completions",
            &stream_headers(20, 100),
            chat("s", "q", 1, true),
        )
        .await;
    let open = tokio::spawn(frames(answer.into_body()));

    let (cert, key) = new.leaf();
    put(&cert_path, &cert);
    put(&key_path, &key);
    let start = Instant::now();
    while Conn::open(proxy.addr, &new.ca_pem(), false).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the new certificate was not taken: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        Conn::open(proxy.addr, &old.ca_pem(), false).await.is_err(),
        "a new handshake still got the old certificate"
    );
    let got = open.await.unwrap();
    assert_eq!(events_in(&got), 20, "the open stream was cut");
    assert!(proxy
        .metrics()
        .await
        .contains("prefixlb_file_reloads_total{kind=\"certificate\",result=\"changed\"} 1"));
    proxy.assert_idle().await;
}

/// Points `link` at `target` the way certbot renews `live/`: a new link renamed over the old.
fn repoint(link: &Path, target: &Path) {
    let tmp = link.with_extension("link");
    std::os::unix::fs::symlink(target, &tmp).unwrap();
    std::fs::rename(&tmp, link).unwrap();
}

#[tokio::test]
async fn a_certificate_behind_a_repointed_symlink_is_followed() {
    let up = start_upstream("a").await;
    let (old, new) = (Pki::new("old ca"), Pki::new("new ca"));
    let dir = tempfile::tempdir().unwrap();
    let (archive, live) = (dir.path().join("archive"), dir.path().join("live"));
    std::fs::create_dir_all(&archive).unwrap();
    std::fs::create_dir_all(&live).unwrap();
    let (cert_link, key_link) = (live.join("fullchain.pem"), live.join("privkey.pem"));
    for (n, pki) in [(1, &old), (2, &new)] {
        let (cert, key) = pki.leaf();
        put(&archive.join(format!("fullchain{n}.pem")), &cert);
        put(&archive.join(format!("privkey{n}.pem")), &key);
    }
    repoint(&cert_link, &archive.join("fullchain1.pem"));
    repoint(&key_link, &archive.join("privkey1.pem"));
    let proxy = start_proxy(
        &TestConfig::new()
            .listen_tls(&cert_link, &key_link)
            .peers(&[&up]),
    )
    .await;
    assert!(Conn::open(proxy.addr, &old.ca_pem(), false).await.is_ok());
    repoint(&cert_link, &archive.join("fullchain2.pem"));
    repoint(&key_link, &archive.join("privkey2.pem"));
    let start = Instant::now();
    while Conn::open(proxy.addr, &new.ca_pem(), false).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the renewed link was not followed: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_peer_behind_tls_is_reached_checked_and_refused_when_untrusted() {
    let pki = Pki::new("engine ca");
    let (cert, key) = pki.leaf();
    let up = start_tls_upstream("tls-engine", &cert, &key).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    put(&ca_file, &pki.ca_pem());
    let peer = TestConfig::new()
        .peer(PeerEntry::at(up.addr).tls("localhost"))
        .health_check_interval_ms(100);
    let trusted = start_proxy(&peer.clone().upstream_ca_file(&ca_file)).await;
    let answer = client()
        .post(trusted.url("/v1/chat/completions"))
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["x-upstream"], "tls-engine");
    // Health checks reach it over TLS too.
    let start = Instant::now();
    while up.health_checks.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "no health check");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listing = trusted.peers().await;
    assert_eq!(listing["peers"][0]["healthy"], true);
    assert_eq!(listing["peers"][0]["tls"], "localhost");

    // Without the CA the engine's certificate is not trusted: nothing reaches it.
    let untrusted = start_proxy(&peer).await;
    let answer = client()
        .post(untrusted.url("/v1/chat/completions"))
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    assert!(
        matches!(answer.status().as_u16(), 502 | 503),
        "{}",
        answer.status()
    );
    assert_eq!(up.seen().len(), 1);
    trusted.assert_idle().await;
    untrusted.assert_idle().await;
}

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
