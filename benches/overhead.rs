//! What prefixlb costs per request: the same closed-loop load straight to a trivial upstream
//! and through prefixlb, side by side in one run (alternating, twice each).
//!
//! `cargo bench --bench overhead`

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::routing::post;
use common::*;

const CONCURRENCY: usize = 32;
const RUN: Duration = Duration::from_secs(5);

/// A fast upstream: a fixed small completion, no model behind it. It reads the request body,
/// as a real server does: one that leaves it unread closes the connection after answering,
/// and a pooled connection closed under a request is a 502 for a POST.
async fn trivial_upstream() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let reply = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#;
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |_body: axum::body::Bytes| async move { reply }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

struct Run {
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    errors: usize,
    first_error: Option<String>,
}

async fn closed_loop(target: SocketAddr) -> Run {
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(CONCURRENCY)
        .build()
        .unwrap();
    let body = r#"{"model":"m","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say ok."}]}"#;
    let url = format!("http://{target}/v1/chat/completions");
    let latencies = Arc::new(Mutex::new(Vec::new()));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let deadline = Instant::now() + RUN;
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|_| {
            let (c, url, latencies, errors) =
                (c.clone(), url.clone(), latencies.clone(), errors.clone());
            tokio::spawn(async move {
                let mut mine = Vec::new();
                while Instant::now() < deadline {
                    let start = Instant::now();
                    let outcome = match c
                        .post(&url)
                        .header("content-type", "application/json")
                        .body(body)
                        .send()
                        .await
                    {
                        Ok(r) if r.status() == 200 => {
                            r.bytes().await.map(|_| ()).map_err(|e| format!("{e:?}"))
                        }
                        Ok(r) => Err(format!(
                            "status {}: {}",
                            r.status(),
                            r.text().await.unwrap_or_default()
                        )),
                        Err(e) => Err(format!("{e:?}")),
                    };
                    match outcome {
                        Ok(()) => mine.push(start.elapsed().as_secs_f64() * 1e6),
                        Err(e) => errors.lock().unwrap().push(e),
                    }
                }
                latencies.lock().unwrap().extend(mine);
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let mut l = latencies.lock().unwrap().clone();
    l.sort_by(f64::total_cmp);
    let errors = errors.lock().unwrap().clone();
    Run {
        rps: l.len() as f64 / RUN.as_secs_f64(),
        p50_us: percentile(&l, 50.0),
        p99_us: percentile(&l, 99.0),
        errors: errors.len(),
        first_error: errors.into_iter().next(),
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 0 {
        (v[mid - 1] + v[mid]) / 2.0
    } else {
        v[mid]
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let upstream = trivial_upstream().await;
    let proxy = start_proxy(&format!(
        "{}health_check: {{enabled: false}}\n",
        peers_yaml_at([upstream], None)
    ))
    .await;
    let lb = proxy.addr;
    // Warm both paths (connection pools, caches) before measuring.
    closed_loop(upstream).await;
    closed_loop(lb).await;
    let (mut direct, mut proxied) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        direct.push(closed_loop(upstream).await);
        proxied.push(closed_loop(lb).await);
    }
    let row = |name: &str, runs: &[Run]| {
        let rps: Vec<f64> = runs.iter().map(|r| r.rps).collect();
        let p50: Vec<f64> = runs.iter().map(|r| r.p50_us).collect();
        let p99: Vec<f64> = runs.iter().map(|r| r.p99_us).collect();
        let errors: usize = runs.iter().map(|r| r.errors).sum();
        if let Some(e) = runs.iter().find_map(|r| r.first_error.as_ref()) {
            eprintln!("{name}: first error: {e}");
        }
        println!(
            "{name:<16} {:>10.0} {:>10.0} {:>10.0} {:>7}",
            median(&rps),
            median(&p50),
            median(&p99),
            errors
        );
        (median(&rps), median(&p50), median(&p99))
    };
    println!("\nclosed loop, {CONCURRENCY} concurrent clients, {} s per run, median of 2 runs, loopback, one 2-core machine\n", RUN.as_secs());
    println!(
        "{:<16} {:>10} {:>10} {:>10} {:>7}",
        "path", "req/s", "p50 µs", "p99 µs", "errors"
    );
    let d = row("direct", &direct);
    let p = row("through prefixlb", &proxied);
    println!(
        "\nthrough prefixlb: {:.0}% of direct throughput, +{:.0} µs at p50, +{:.0} µs at p99",
        p.0 / d.0 * 100.0,
        p.1 - d.1,
        p.2 - d.2
    );
}
