//! What prefixlb costs per request, beside the floor and the reference, in one run: the same
//! closed-loop load (64 keep-alive connections, 64 distinct chat bodies) straight to a trivial
//! upstream, through HAProxy (`roundrobin`), through a bare Pingora proxy (`examples/bare_proxy`:
//! `upstream_peer` and nothing else, set up as prefixlb is), through SMG 1.13 (`cache_aware`)
//! and vllm-router 0.1.17 (`consistent_hash`), and through prefixlb (body peek, key,
//! `least_cost` selection, metrics, access log), for small bodies and for 32 KB ones. Then the
//! same load over TLS through HAProxy and prefixlb terminating it, with a certificate made for
//! the run: HTTP/1.1 with both body sizes, and HTTP/2 with small ones (by ALPN; 8 connections of
//! 8 streams each, reused throughout).
//!
//! The load generator runs on CPU 0; each proxy and the upstream share CPU 1, as a proxy with a
//! core of its own would. Every Pingora proxy runs one worker thread and the same allocator;
//! HAProxy one thread; SMG and vllm-router their Tokio runtime's default, one worker thread per
//! CPU they may run on (one, pinned). Every proxy's CPU time counts all its threads.
//!
//! `cargo bench --bench overhead`

#[path = "../common/mod.rs"]
mod common;
mod load;

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use axum::routing::{get, post};
use common::peers::*;
use common::spread::Spread;
use common::tls::make_certs;
use common::*;
use load::{chat_requests, closed_loop, Load, Run, Transport};

const CONNECTIONS: usize = 64;
/// HTTP/2 carries the same 64 requests in flight on fewer connections.
const H2_CONNECTIONS: usize = 8;
const RUN: Duration = Duration::from_secs(5);
const ROUNDS: usize = 2;
const UPSTREAM_ROLE: &str = "PREFIXLB_BENCH_UPSTREAM";
/// The upstream's model list: the model every request names.
const MODELS: &str = r#"{"object":"list","data":[{"id":"m","object":"model","owned_by":"bench"}]}"#;

fn main() {
    if let Ok(addr) = std::env::var(UPSTREAM_ROLE) {
        serve_upstream(addr.parse().expect("an address"));
        return;
    }
    let pinned = can_pin();
    if pinned {
        pin(LOAD_CPU);
    } else {
        println!("one CPU only: nothing is pinned, and the figures mix load and proxy");
    }
    let upstream_addr = free_addr();
    let _upstream = spawn_pinned(
        Command::new(std::env::current_exe().expect("this bench's path"))
            .env(UPSTREAM_ROLE, upstream_addr.to_string()),
        pinned,
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(bench(upstream_addr, pinned));
}

/// Where the load goes, and what keeps it serving.
#[derive(Clone)]
struct Target {
    name: &'static str,
    addr: SocketAddr,
    /// The proxy process, whose CPU time is counted; none for the upstream itself.
    pid: Option<u32>,
    _serving: Option<std::rc::Rc<dyn std::any::Any>>,
}

fn started(
    name: &'static str,
    started: Result<(SocketAddr, peers::Killed), String>,
) -> Option<Target> {
    match started {
        Ok((addr, child)) => Some(Target {
            name,
            addr,
            pid: Some(child.child.id()),
            _serving: Some(std::rc::Rc::new(child)),
        }),
        Err(why) => {
            println!("{name}: skipped ({why})");
            None
        }
    }
}

fn start_prefixlb(
    name: &'static str,
    upstream: SocketAddr,
    listen: TestConfig,
    pinned: bool,
) -> Target {
    let proxy = spawn_proxy_adjusted(
        &listen
            .peers_at([upstream])
            .no_health_check()
            .access_log("plain"),
        &PingoraConfig::new().threads(1),
        |c| pin_command(c, pinned),
    );
    Target {
        name,
        addr: proxy.addr,
        pid: Some(proxy.pid()),
        _serving: Some(std::rc::Rc::new(proxy)),
    }
}

async fn bench(upstream: SocketAddr, pinned: bool) {
    wait_listening(upstream, "the upstream").await;
    let mut plain = vec![Target {
        name: "direct",
        addr: upstream,
        pid: None,
        _serving: None,
    }];
    plain.extend(started(
        "HAProxy roundrobin",
        start_haproxy(&[upstream], "roundrobin", pinned, 4096, "").await,
    ));
    plain.extend(started("bare Pingora", start_bare(upstream, pinned).await));
    // The Rust routers from PyPI, each as its users run it for prefix reuse (their set-up and
    // why: `benches/common/pypi_routers.rs`). Only plain HTTP: neither terminates TLS here.
    plain.extend(started(
        "SMG cache_aware",
        start_smg_in_front(upstream, pinned, &[]).await,
    ));
    plain.extend(started(
        "vllm-router consistent_hash",
        start_vllm_router_in_front(upstream, pinned).await,
    ));
    plain.push(start_prefixlb(
        "prefixlb",
        upstream,
        TestConfig::new(),
        pinned,
    ));

    let certs = make_certs();
    let haproxy_tls = started(
        "HAProxy roundrobin",
        start_haproxy(
            &[upstream],
            "roundrobin",
            pinned,
            4096,
            &format!("ssl crt {} alpn h2,http/1.1", certs.combined.display()),
        )
        .await,
    );
    let tls_listen = TestConfig::new().listen_tls(&certs.cert, &certs.key);
    let prefixlb_tls = start_prefixlb("prefixlb", upstream, tls_listen, pinned);
    let tls: Vec<Target> = haproxy_tls.into_iter().chain([prefixlb_tls]).collect();
    for t in plain.iter().chain(&tls) {
        wait_listening(t.addr, t.name).await;
    }

    let (small, large) = (chat_requests(2 * 1024), chat_requests(32 * 1024));
    let groups = [
        ("~2 KB bodies", Transport::Plain, &plain, &small),
        ("32 KB bodies", Transport::Plain, &plain, &large),
        (
            "TLS, HTTP/1.1, ~2 KB bodies",
            Transport::TlsH1,
            &tls,
            &small,
        ),
        (
            "TLS, HTTP/1.1, 32 KB bodies",
            Transport::TlsH1,
            &tls,
            &large,
        ),
        ("TLS, HTTP/2, ~2 KB bodies", Transport::TlsH2, &tls, &small),
    ];
    // "added µs" counts from the plain direct run of the same bodies.
    let mut direct = std::collections::HashMap::new();
    for (label, transport, targets, requests) in groups {
        let load = Load {
            transport,
            requests: requests.clone(),
            ca_pem: certs.ca_pem.clone(),
        };
        let runs = measure(targets, &load).await;
        if transport == Transport::Plain {
            direct.insert(requests.len() * requests[0].len(), rps_of(&runs[0]));
        }
        let baseline = direct[&(requests.len() * requests[0].len())];
        report(label, targets, &runs, baseline);
    }
}

/// Each target's runs: a warm-up, then `ROUNDS` runs taken in turn.
async fn measure(targets: &[Target], load: &Load) -> Vec<Vec<Run>> {
    // Warm every path (pools, caches, sessions) before measuring.
    for t in targets {
        closed_loop(t.addr, load, Duration::from_secs(1)).await;
    }
    let mut runs: Vec<Vec<Run>> = targets.iter().map(|_| Vec::new()).collect();
    for _ in 0..ROUNDS {
        for (i, t) in targets.iter().enumerate() {
            let cpu_before = t.pid.map(cpu_time);
            let mut run = closed_loop(t.addr, load, RUN).await;
            if let (Some(pid), Some(before)) = (t.pid, cpu_before) {
                run.cpu = Some(cpu_time(pid) - before);
            }
            runs[i].push(run);
        }
    }
    runs
}

fn rps_of(runs: &[Run]) -> f64 {
    median(&runs.iter().map(Run::rps).collect::<Vec<_>>())
}

fn report(label: &str, targets: &[Target], runs: &[Vec<Run>], direct: f64) {
    println!(
        "\n{label}: {CONNECTIONS} requests in flight, closed loop, {} s runs, median of {ROUNDS}\n",
        RUN.as_secs()
    );
    // The ratios are of req/s: each row's over HAProxy's and over the bare proxy's, and
    // prefixlb's over each row's.
    println!(
        "{:<28} {:>9} {:>8} {:>8} {:>10} {:>10} {:>8} {:>8} {:>10} {:>7}",
        "target",
        "req/s",
        "p50 µs",
        "p99 µs",
        "added µs",
        "CPU µs/req",
        "vs HAP",
        "vs bare",
        "prefixlb ×",
        "errors"
    );
    let rps = |i: usize| rps_of(&runs[i]);
    let find = |name: &str| targets.iter().position(|t| t.name.starts_with(name));
    let (haproxy, bare) = (find("HAProxy").map(rps), find("bare").map(rps));
    let prefixlb = targets.iter().position(|t| t.name == "prefixlb");
    for (i, t) in targets.iter().enumerate() {
        let name = t.name;
        let r = &runs[i];
        let p = |q: f64| {
            median(
                &r.iter()
                    .map(|x| percentile(&x.latencies, q))
                    .collect::<Vec<_>>(),
            )
        };
        let cpu: Vec<f64> = r
            .iter()
            .filter_map(|x| {
                x.cpu
                    .map(|c| c.as_secs_f64() * 1e6 / x.requests.max(1) as f64)
            })
            .collect();
        let ratio = |of: Option<f64>| of.map_or("-".into(), |o| format!("{:.2}", rps(i) / o));
        let over_this = match prefixlb {
            Some(p) if p != i => format!("{:.2}", rps(p) / rps(i)),
            _ => "-".into(),
        };
        let errors: usize = r.iter().map(|x| x.errors).sum();
        if let Some(e) = r.iter().find_map(|x| x.first_error.as_ref()) {
            eprintln!("{name}: first error: {e}");
        }
        println!(
            "{:<28} {:>9.0} {:>8.0} {:>8.0} {:>10} {:>10} {:>8} {:>8} {:>10} {:>7}",
            name,
            rps(i),
            p(50.0),
            p(99.0),
            if t.pid.is_none() {
                "-".into()
            } else {
                format!("{:.1}", 1e6 / rps(i) - 1e6 / direct)
            },
            if cpu.is_empty() {
                "-".into()
            } else {
                format!("{:.1}", median(&cpu))
            },
            ratio(haproxy),
            ratio(bare),
            over_this,
            errors
        );
    }
}

/// A fast upstream: a fixed small completion, no model behind it. It reads the request body,
/// as a real server does (one that leaves it unread closes the connection after answering).
/// It answers what SMG and vllm-router ask of a worker before they take it: `/health`, and the
/// model list (SMG sends a request only to a worker that listed the model it names).
fn serve_upstream(addr: SocketAddr) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.expect("the upstream's port");
        let reply = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#;
        let app = axum::Router::new()
            .route(
                "/v1/chat/completions",
                post(move |_body: axum::body::Bytes| async move { reply }),
            )
            .route("/health", get(|| async { "ok" }))
            .route("/v1/models", get(|| async { MODELS }));
        axum::serve(listener, app).await.expect("the upstream serves");
    });
}

fn median(v: &[f64]) -> f64 {
    Spread::of(v.to_vec()).median
}
