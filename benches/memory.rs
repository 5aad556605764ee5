//! What an open stream and an idle connection cost in memory, beside HAProxy, the bare Pingora
//! proxy (`examples/bare_proxy`, set up as prefixlb is), SMG 1.13 (`cache_aware`) and
//! vllm-router 0.1.17 (`consistent_hash`), in one run: 5,000 SSE streams held open through each
//! proxy (an upstream that sends a token every 100 ms), then 8,000 idle keep-alive connections.
//! HAProxy and prefixlb again terminating TLS (HTTP/1.1, a certificate made for the run).
//! The figure is the proxy's resident memory with them open, less its resident memory before.
//! SMG and vllm-router are Rust routers run inside a Python process: their resident memory at
//! rest includes the interpreter's.
//!
//! `cargo bench --bench memory [-- NAME]`: NAME keeps only the proxies whose name contains it.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use common::peers::*;
use common::tls::{make_certs, open, Certs};
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;

const STREAMS: usize = 5_000;
/// As many as fit under this machine's 20,000 descriptors per process, each proxy holding one
/// per idle client and HAProxy two per connection of its `maxconn`.
const IDLE: usize = 8_000;
const TOKEN_EVERY: Duration = Duration::from_millis(100);
/// Long enough to open every stream and measure with all of them still running.
const TOKENS: u64 = 400;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(bench());
}

struct Target {
    name: &'static str,
    addr: SocketAddr,
    pid: u32,
    /// How its clients connect over TLS; `None`: in the clear.
    tls: Option<TlsConnector>,
    _serving: Box<dyn std::any::Any>,
}

/// The proxies, freshly started (one worker thread each, where the proxy lets it be set): memory
/// an allocator kept from one phase must not hide the next one's. Those that cannot start are
/// left out, and said so when `say_skipped`.
async fn start_targets(upstream: SocketAddr, certs: &Certs, say_skipped: bool) -> Vec<Target> {
    let mut targets: Vec<Target> = Vec::new();
    // No ALPN offered: HTTP/1.1, as most API clients speak it.
    let client = tls_connector(&certs.ca_pem, &[]);
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let wanted = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    type Starting<'a> = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<(SocketAddr, Killed), String>> + 'a>,
    >;
    let crt = format!("ssl crt {} alpn http/1.1", certs.combined.display());
    let upstreams = [upstream];
    // SMG and vllm-router: their set-up and why in `benches/common/pypi_routers.rs`. Besides,
    // SMG bounds the requests it holds (1,024 per core, at least 4,096, by default), and would
    // refuse part of the 5,000 streams; 0 lifts the bound (`--max-concurrent-requests` help),
    // as none of the other proxies here has one. vllm-router's default bound, 32,768, is above
    // the streams.
    let peers: [(&'static str, bool, Starting); 5] = [
        (
            "HAProxy",
            false,
            Box::pin(start_haproxy(&upstreams, "roundrobin", false, 9_000, "")),
        ),
        (
            "HAProxy TLS",
            true,
            Box::pin(start_haproxy(&upstreams, "roundrobin", false, 9_000, &crt)),
        ),
        ("bare Pingora", false, Box::pin(start_bare(upstream, false))),
        (
            "SMG",
            false,
            Box::pin(start_smg_in_front(
                upstream,
                false,
                &["--max-concurrent-requests", "0"],
            )),
        ),
        (
            "vllm-router",
            false,
            Box::pin(start_vllm_router_in_front(upstream, false)),
        ),
    ];
    // Futures do nothing until awaited: a peer left out by the filter never starts.
    for (name, tls, starting) in peers {
        if !wanted(name) {
            continue;
        }
        match starting.await {
            Ok((addr, child)) => targets.push(Target {
                name,
                addr,
                pid: child.child.id(),
                tls: tls.then(|| client.clone()),
                _serving: Box::new(child),
            }),
            Err(why) if say_skipped => println!("{name}: skipped ({why})"),
            Err(_) => {}
        }
    }
    let config = TestConfig::new()
        .peers_at([upstream])
        .no_health_check()
        .access_log("off");
    for (name, config, tls) in [
        ("prefixlb", config.clone(), None),
        (
            "prefixlb TLS",
            config.listen_tls(&certs.cert, &certs.key),
            Some(client.clone()),
        ),
    ] {
        if !wanted(name) {
            continue;
        }
        let proxy = start_proxy_with(&config, &PingoraConfig::new().threads(1)).await;
        targets.push(Target {
            name,
            addr: proxy.addr,
            pid: proxy.pid(),
            tls,
            _serving: Box::new(proxy),
        });
    }
    targets
}

async fn bench() {
    let upstream = streaming_upstream().await;
    let certs = make_certs();
    println!(
        "\n{STREAMS} SSE streams (a token every {} ms), and {IDLE} idle keep-alive connections, each on a fresh process\n",
        TOKEN_EVERY.as_millis()
    );
    println!(
        "{:<14} {:>9} {:>12} {:>12} {:>12} {:>13} {:>7}",
        "proxy", "RSS at rest", "RSS streams", "per stream", "RSS idle c.", "per idle c.", "errors"
    );
    let mut streams_rows = Vec::new();
    for t in start_targets(upstream, &certs, true).await {
        let (name, pid) = (t.name, t.pid);
        let before = rss(pid);
        let tokens = Arc::new(AtomicU64::new(0));
        let (streams, errors) = open_streams(t.addr, t.tls.as_ref(), &tokens).await;
        // Every stream is flowing: each has had a few tokens.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let flowing = tokens.load(Ordering::Relaxed);
        let with_streams = rss(pid);
        drop(streams);
        if flowing < STREAMS as u64 {
            println!("  ({name}: only {flowing} tokens arrived over {STREAMS} streams)");
        }
        streams_rows.push((name, before, with_streams, errors));
    }
    let mut idle_rows = std::collections::HashMap::new();
    for t in start_targets(upstream, &certs, false).await {
        let before = rss(t.pid);
        let idle = open_idle(t.addr, t.tls.as_ref()).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        idle_rows.insert(t.name, (before, rss(t.pid), IDLE - idle.len()));
    }
    let per = |more: u64, base: u64, n: usize| more.saturating_sub(base) as f64 / n as f64 / 1024.0;
    for (name, before, with_streams, errors) in streams_rows {
        // A proxy that started for the streams and not again for the idle connections.
        let Some(&(idle_before, with_idle, idle_errors)) = idle_rows.get(name) else {
            println!("{name}: no idle-connection figures (it did not start again)");
            continue;
        };
        println!(
            "{:<14} {:>9.1} M {:>10.1} M {:>8.1} KiB {:>10.1} M {:>9.1} KiB {:>7}",
            name,
            mib(before),
            mib(with_streams),
            per(with_streams, before, STREAMS),
            mib(with_idle),
            per(with_idle, idle_before, IDLE),
            errors + idle_errors
        );
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// An upstream whose every chat answer is an SSE stream of `TOKENS` tokens, `TOKEN_EVERY` apart.
/// It answers what SMG and vllm-router ask of a worker before they take it: `/health`, and the
/// model list (SMG sends a request only to a worker that listed the model it names).
async fn streaming_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new()
        .route(
            "/v1/models",
            axum::routing::get(|| async {
                r#"{"object":"list","data":[{"id":"m","object":"model","owned_by":"bench"}]}"#
            }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }))
        .route(
            "/v1/chat/completions",
            post(|_body: axum::body::Bytes| async {
                let tokens = futures_util::stream::unfold(0u64, |i| async move {
                    if i == TOKENS {
                        return None;
                    }
                    tokio::time::sleep(TOKEN_EVERY).await;
                    let event = format!("data: {{\"i\":{i},\"delta\":\"tok\"}}\n\n");
                    Some((Ok::<_, Infallible>(event), i + 1))
                });
                axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(Body::from_stream(tokens))
                    .unwrap()
            }),
        );
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn request(i: usize) -> String {
    let body = format!(
        r#"{{"model":"m","stream":true,"messages":[{{"role":"system","content":"Be terse."}},{{"role":"user","content":"Stream {i}."}}]}}"#
    );
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Open streams, each read by a task; dropped, they close.
struct Streams(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Streams {
    fn drop(&mut self) {
        for s in &self.0 {
            s.abort();
        }
    }
}

/// Opens `STREAMS` streams, each read by a task that counts the tokens.
async fn open_streams(
    addr: SocketAddr,
    tls: Option<&TlsConnector>,
    tokens: &Arc<AtomicU64>,
) -> (Streams, usize) {
    let (mut streams, mut errors) = (Vec::with_capacity(STREAMS), 0);
    for i in 0..STREAMS {
        let mut s = match open(addr, tls).await {
            Ok(s) => s,
            Err(_) => {
                errors += 1;
                continue;
            }
        };
        if s.write_all(request(i).as_bytes()).await.is_err() {
            errors += 1;
            continue;
        }
        let tokens = Arc::clone(tokens);
        streams.push(tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = s.read(&mut buf).await {
                let events = buf[..n].windows(6).filter(|w| w == b"data: ").count();
                tokens.fetch_add(events as u64, Ordering::Relaxed);
            }
        }));
    }
    (Streams(streams), errors)
}

/// `IDLE` keep-alive connections, each idle after one short request (a model list).
async fn open_idle(addr: SocketAddr, tls: Option<&TlsConnector>) -> Vec<Box<dyn common::tls::Io>> {
    let mut idle = Vec::with_capacity(IDLE);
    for _ in 0..IDLE {
        let Ok(mut s) = open(addr, tls).await else {
            continue;
        };
        let asked = s
            .write_all(b"GET /v1/models HTTP/1.1\r\nHost: bench\r\n\r\n")
            .await;
        let mut buf = [0u8; 1024];
        if asked.is_ok() && matches!(s.read(&mut buf).await, Ok(1..)) {
            idle.push(s);
        }
    }
    idle
}
