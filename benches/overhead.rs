//! What prefixlb costs per request, beside the floor and the reference, in one run: the same
//! closed-loop load (64 keep-alive connections, 64 distinct chat bodies) straight to a trivial
//! upstream, through HAProxy (`roundrobin`), through a bare Pingora proxy (`examples/bare_proxy`:
//! `upstream_peer` and nothing else) and through prefixlb (body peek, key, bounded selection,
//! metrics, access log), for small bodies and for 32 KB ones.
//!
//! The load generator runs on CPU 0; each proxy and the upstream share CPU 1, as a proxy with a
//! core of its own would. Every proxy runs one worker thread and the same allocator.
//!
//! `cargo bench --bench overhead`

mod common;

use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use axum::routing::post;
use bytes::BytesMut;
use common::peers::*;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CONNECTIONS: usize = 64;
const RUN: Duration = Duration::from_secs(5);
const ROUNDS: usize = 2;
const UPSTREAM_ROLE: &str = "PREFIXLB_BENCH_UPSTREAM";

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
struct Target {
    name: &'static str,
    addr: SocketAddr,
    /// The proxy process, whose CPU time is counted; none for the upstream itself.
    pid: Option<u32>,
    _serving: Option<Box<dyn std::any::Any>>,
}

async fn bench(upstream: SocketAddr, pinned: bool) {
    wait_listening(upstream, "the upstream").await;
    let mut targets = vec![Target {
        name: "direct",
        addr: upstream,
        pid: None,
        _serving: None,
    }];
    for (name, started) in [
        (
            "HAProxy roundrobin",
            start_haproxy(&[upstream], "roundrobin", pinned, 4096).await,
        ),
        ("bare Pingora", start_bare(upstream, pinned).await),
    ] {
        match started {
            Ok((addr, child)) => targets.push(Target {
                name,
                addr,
                pid: Some(child.child.id()),
                _serving: Some(Box::new(child)),
            }),
            Err(why) => println!("{name}: skipped ({why})"),
        }
    }
    let proxy = spawn_proxy_adjusted(
        &format!(
            "{}health_check: {{enabled: false}}\naccess_log: plain\n",
            peers_yaml_at([upstream], None)
        ),
        "threads: 1\n",
        |c| pin_command(c, pinned),
    );
    proxy.wait_ready().await;
    targets.push(Target {
        name: "prefixlb",
        addr: proxy.addr,
        pid: Some(proxy.pid()),
        _serving: Some(Box::new(proxy)),
    });

    for (label, body_bytes) in [("~2 KB bodies", 2 * 1024), ("32 KB bodies", 32 * 1024)] {
        let requests = chat_requests(body_bytes);
        // Warm every path (pools, caches) before measuring.
        for t in &targets {
            closed_loop(t.addr, &requests, Duration::from_secs(1)).await;
        }
        let mut runs: Vec<Vec<Run>> = targets.iter().map(|_| Vec::new()).collect();
        for _ in 0..ROUNDS {
            for (i, t) in targets.iter().enumerate() {
                let cpu_before = t.pid.map(cpu_time);
                let mut run = closed_loop(t.addr, &requests, RUN).await;
                if let (Some(pid), Some(before)) = (t.pid, cpu_before) {
                    run.cpu = Some(cpu_time(pid) - before);
                }
                runs[i].push(run);
            }
        }
        report(label, &targets, &runs);
    }
}

struct Run {
    requests: usize,
    elapsed: Duration,
    /// Microseconds, sorted.
    latencies: Vec<f64>,
    errors: usize,
    first_error: Option<String>,
    /// CPU time the proxy process used during the run.
    cpu: Option<Duration>,
}

impl Run {
    fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}

fn report(label: &str, targets: &[Target], runs: &[Vec<Run>]) {
    println!(
        "\n{label}: {CONNECTIONS} connections, closed loop, {} s runs, median of {ROUNDS}\n",
        RUN.as_secs()
    );
    println!(
        "{:<20} {:>9} {:>8} {:>8} {:>10} {:>10} {:>8} {:>8} {:>7}",
        "target",
        "req/s",
        "p50 µs",
        "p99 µs",
        "added µs",
        "CPU µs/req",
        "vs HAP",
        "vs bare",
        "errors"
    );
    let rps = |i: usize| median(&runs[i].iter().map(Run::rps).collect::<Vec<_>>());
    let find = |name: &str| targets.iter().position(|t| t.name.starts_with(name));
    let direct = rps(0);
    let (haproxy, bare) = (find("HAProxy").map(rps), find("bare").map(rps));
    for (i, Target { name, .. }) in targets.iter().enumerate() {
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
        let errors: usize = r.iter().map(|x| x.errors).sum();
        if let Some(e) = r.iter().find_map(|x| x.first_error.as_ref()) {
            eprintln!("{name}: first error: {e}");
        }
        println!(
            "{:<20} {:>9.0} {:>8.0} {:>8.0} {:>10} {:>10} {:>8} {:>8} {:>7}",
            name,
            rps(i),
            p(50.0),
            p(99.0),
            if i == 0 {
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
            errors
        );
    }
}

/// 64 distinct chat requests of about `size` bytes each (distinct conversations: distinct keys).
fn chat_requests(size: usize) -> Vec<Vec<u8>> {
    (0..64)
        .map(|i| {
            let filler = "The patient reports mild symptoms. ".repeat(size / 36);
            let body = format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"You are terse. {filler}"}},{{"role":"user","content":"Conversation {i}: say ok."}}]}}"#
            );
            let mut request = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            request.extend_from_slice(body.as_bytes());
            request
        })
        .collect()
}

/// `CONNECTIONS` keep-alive connections, each sending its next request as soon as the last
/// answer is read, for `length`.
async fn closed_loop(target: SocketAddr, requests: &[Vec<u8>], length: Duration) -> Run {
    let start = Instant::now();
    let deadline = start + length;
    let requests = std::sync::Arc::new(requests.to_vec());
    let tasks: Vec<_> = (0..CONNECTIONS)
        .map(|c| tokio::spawn(connection(target, requests.clone(), c, deadline)))
        .collect();
    let (mut latencies, mut errors, mut first_error) = (Vec::new(), 0, None);
    for t in tasks {
        let (l, e, first) = t.await.expect("a connection task");
        latencies.extend(l);
        errors += e;
        first_error = first_error.or(first);
    }
    latencies.sort_by(f64::total_cmp);
    Run {
        requests: latencies.len(),
        elapsed: start.elapsed(),
        latencies,
        errors,
        first_error,
        cpu: None,
    }
}

async fn connection(
    target: SocketAddr,
    requests: std::sync::Arc<Vec<Vec<u8>>>,
    first: usize,
    deadline: Instant,
) -> (Vec<f64>, usize, Option<String>) {
    let (mut latencies, mut errors, mut first_error) = (Vec::new(), 0usize, None);
    let mut next = first;
    let mut stream: Option<tokio::net::TcpStream> = None;
    let mut buf = BytesMut::with_capacity(64 * 1024);
    while Instant::now() < deadline {
        let s = match stream.as_mut() {
            Some(s) => s,
            None => match tokio::net::TcpStream::connect(target).await {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    buf.clear();
                    stream.insert(s)
                }
                Err(e) => {
                    errors += 1;
                    first_error.get_or_insert(format!("connect: {e}"));
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let request = &requests[next % requests.len()];
        next += CONNECTIONS;
        let sent = Instant::now();
        match exchange(s, request, &mut buf).await {
            Ok(()) => latencies.push(sent.elapsed().as_secs_f64() * 1e6),
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(e);
                stream = None;
            }
        }
    }
    (latencies, errors, first_error)
}

/// One request and its whole answer, which must be a 200 with a length.
async fn exchange(
    s: &mut tokio::net::TcpStream,
    request: &[u8],
    buf: &mut BytesMut,
) -> Result<(), String> {
    s.write_all(request)
        .await
        .map_err(|e| format!("write: {e}"))?;
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut response = httparse::Response::new(&mut headers);
        match response.parse(buf) {
            Ok(httparse::Status::Complete(head)) => {
                if response.code != Some(200) {
                    return Err(format!("status {:?}", response.code));
                }
                let length = response
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .and_then(|h| {
                        std::str::from_utf8(h.value)
                            .ok()?
                            .trim()
                            .parse::<usize>()
                            .ok()
                    })
                    .ok_or("an answer without Content-Length")?;
                while buf.len() < head + length {
                    read_more(s, buf).await?;
                }
                let _ = buf.split_to(head + length);
                return Ok(());
            }
            Ok(httparse::Status::Partial) => read_more(s, buf).await?,
            Err(e) => return Err(format!("unreadable answer: {e}")),
        }
    }
}

async fn read_more(s: &mut tokio::net::TcpStream, buf: &mut BytesMut) -> Result<(), String> {
    buf.reserve(16 * 1024);
    match s.read_buf(buf).await {
        Ok(0) => Err("closed".into()),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("read: {e}")),
    }
}

/// A fast upstream: a fixed small completion, no model behind it. It reads the request body,
/// as a real server does (one that leaves it unread closes the connection after answering).
fn serve_upstream(addr: SocketAddr) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.expect("the upstream's port");
        let reply = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#;
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            post(move |_body: axum::body::Bytes| async move { reply }),
        );
        axum::serve(listener, app).await.expect("the upstream serves");
    });
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 0 => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        n => v[n / 2],
    }
}
