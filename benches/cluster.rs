//! The cluster benchmark: the same seeded multi-turn workload through prefixlb under each
//! routing policy, in front of the same simulated GPUs, side by side in one run.
//!
//! `cargo bench --bench cluster` prints the table and writes `results.json` and
//! `results.svg` to `target/bench-results/` (or `$BENCH_OUT`).
//!
//! The workload: sessions of one of six departments, each department with its own long system
//! prompt; one department has half of all sessions (hundreds of doctors on one prompt). Its
//! sessions use `/v1/completions` with the whole conversation as one text prompt, so their key
//! (the first 2048 characters) is the shared template: one hot key. The others chat, each
//! conversation its own key. Sessions resend their whole history every turn, think between
//! turns, and a third of them arrive in a burst at the start.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

const POLICIES: [&str; 4] = [
    "round_robin",
    "least_in_flight",
    "consistent_hash",
    "bounded_consistent_hash",
];
const GPUS: usize = 4;
const SESSIONS: usize = 120;
const SPEED: f64 = 2.0;
const SEED: u64 = 20261201;

struct Turn {
    user: String,
    think: Duration,
    max_tokens: usize,
}

struct Session {
    dept: usize,
    start: Duration,
    turns: Vec<Turn>,
}

const WORDS: &[&str] = &[
    "patient", "history", "dose", "allergy", "symptom", "protocol", "triage", "follow", "review",
    "chart", "note", "fever", "pain", "scan", "result", "referral", "plan", "check", "urgent",
    "routine", "clinic", "ward", "nurse", "report", "consent", "record", "summary", "advice",
];

/// Random words, `range` characters long (give or take a word).
fn words(rng: &mut StdRng, range: std::ops::Range<usize>) -> String {
    let chars = rng.random_range(range);
    let mut s = String::with_capacity(chars + 16);
    while s.len() < chars {
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        s.push(' ');
    }
    s
}

fn workload() -> (Vec<String>, Vec<Session>) {
    let mut rng = StdRng::seed_from_u64(SEED);
    let prompts = (0..6)
        .map(|d| {
            format!(
                "You are the assistant of department {d}. Protocol: {}",
                words(&mut rng, 2500..5000)
            )
        })
        .collect();
    let sessions = (0..SESSIONS)
        .map(|i| {
            let dept = if rng.random_bool(0.5) {
                0
            } else {
                rng.random_range(1..6)
            };
            let start = if i % 3 == 0 {
                Duration::from_millis(rng.random_range(0..1500))
            } else {
                Duration::from_millis(rng.random_range(0..15_000))
            };
            let turns = (0..rng.random_range(4..9))
                .map(|_| Turn {
                    user: words(&mut rng, 600..2400),
                    // Exponential, mean 1.2 s.
                    think: Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() * 1.2),
                    max_tokens: rng.random_range(24..72),
                })
                .collect();
            Session { dept, start, turns }
        })
        .collect();
    (prompts, sessions)
}

/// What the simulator answers to `n` tokens: the history every next turn carries.
fn answer(n: usize) -> String {
    (0..n).map(|i| format!("tok{i} ")).collect()
}

#[derive(Clone, Copy)]
struct Stat {
    ttft_ms: f64,
    e2e_ms: f64,
    ok: bool,
}

async fn run_session(
    c: reqwest::Client,
    lb: SocketAddr,
    system: String,
    s: Session,
    stats: Arc<Mutex<Vec<Stat>>>,
) {
    tokio::time::sleep(s.start.div_f64(SPEED)).await;
    let chat_api = s.dept != 0;
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut text = format!("{system}\n");
    for t in s.turns {
        let (url, body) = if chat_api {
            messages.push(json!({"role": "user", "content": t.user}));
            (
                format!("http://{lb}/v1/chat/completions"),
                json!({"model": "m", "stream": true, "max_tokens": t.max_tokens, "messages": messages}),
            )
        } else {
            text.push_str(&format!("Doctor: {}\nAssistant: ", t.user));
            (
                format!("http://{lb}/v1/completions"),
                json!({"model": "m", "stream": true, "max_tokens": t.max_tokens, "prompt": text}),
            )
        };
        let start = Instant::now();
        let mut ttft = None;
        let ok = async {
            let r = c.post(&url).json(&body).send().await.ok()?;
            if r.status() != 200 {
                return None;
            }
            let mut stream = r.bytes_stream();
            let mut all = String::new();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.ok()?;
                all.push_str(&String::from_utf8_lossy(&chunk));
                // The first token may be split across network chunks: look at all so far.
                if ttft.is_none() && all.contains("\"tok0 ") {
                    ttft = Some(start.elapsed());
                }
            }
            all.ends_with("data: [DONE]\n\n").then_some(())
        }
        .await
        .is_some();
        let e2e = start.elapsed();
        stats.lock().unwrap().push(Stat {
            ttft_ms: ttft.unwrap_or(e2e).as_secs_f64() * 1000.0,
            e2e_ms: e2e.as_secs_f64() * 1000.0,
            ok,
        });
        let reply = answer(t.max_tokens);
        if chat_api {
            messages.push(json!({"role": "assistant", "content": reply}));
        } else {
            text.push_str(&reply);
            text.push('\n');
        }
        tokio::time::sleep(t.think.div_f64(SPEED)).await;
    }
}

struct PolicyResult {
    policy: &'static str,
    stats: Vec<Stat>,
    wall: Duration,
    hit_ratio: f64,
    served: Vec<f64>,
    /// (seconds, running + waiting per GPU)
    load: Vec<(f64, Vec<f64>)>,
}

async fn scrape(c: &reqwest::Client, gpu: SocketAddr) -> String {
    match c.get(format!("http://{gpu}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

async fn run_policy(policy: &'static str) -> PolicyResult {
    let sim_args: Vec<String> = [
        "--speed",
        &SPEED.to_string(),
        "--cache-tokens",
        "65536",
        "--max-running",
        "16",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (_sims, gpus) = start_sims(GPUS, &sim_args).await;
    let extra = format!("routing: {{policy: {policy}}}\nhealth_check: {{enabled: false}}\n");
    // The access log stays on, as by default: its cost is part of what is measured.
    let proxy = start_proxy(&format!(
        "{}{extra}",
        peers_yaml_at(gpus.iter().copied(), Some(32))
    ))
    .await;
    let lb = proxy.addr;
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    let (prompts, sessions) = workload();
    let stats = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let tasks: Vec<_> = sessions
        .into_iter()
        .map(|s| {
            tokio::spawn(run_session(
                c.clone(),
                lb,
                prompts[s.dept].clone(),
                s,
                Arc::clone(&stats),
            ))
        })
        .collect();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (c, gpus, done) = (c.clone(), gpus.clone(), Arc::clone(&done));
        tokio::spawn(async move {
            let mut load = Vec::new();
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let t = start.elapsed().as_secs_f64();
                let mut row = Vec::new();
                for g in &gpus {
                    let m = scrape(&c, *g).await;
                    row.push(
                        sample(&m, "vllm:num_requests_running")
                            + sample(&m, "vllm:num_requests_waiting"),
                    );
                }
                load.push((t, row));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            load
        })
    };
    for t in tasks {
        t.await.unwrap();
    }
    let wall = start.elapsed();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let load = sampler.await.unwrap_or_default();
    let (mut hits, mut queries, mut served) = (0.0, 0.0, Vec::new());
    for g in &gpus {
        let m = scrape(&c, *g).await;
        hits += sample(&m, "vllm:prefix_cache_hits_total");
        queries += sample(&m, "vllm:prefix_cache_queries_total");
        served.push(sample(&m, "vllm:request_success_total"));
    }
    let stats = stats.lock().unwrap().clone();
    PolicyResult {
        policy,
        stats,
        wall,
        hit_ratio: if queries > 0.0 { hits / queries } else { 0.0 },
        served,
        load,
    }
}

impl PolicyResult {
    fn ttfts(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .stats
            .iter()
            .filter(|s| s.ok)
            .map(|s| s.ttft_ms)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    }

    fn summary(&self) -> serde_json::Value {
        let ttft = self.ttfts();
        let ok: Vec<&Stat> = self.stats.iter().filter(|s| s.ok).collect();
        let mean_e2e = ok.iter().map(|s| s.e2e_ms).sum::<f64>() / ok.len().max(1) as f64;
        let total: f64 = self.served.iter().sum();
        let mean_share = total / self.served.len() as f64;
        let max_share = self.served.iter().copied().fold(0.0, f64::max);
        json!({
            "policy": self.policy,
            "requests": self.stats.len(),
            "errors": self.stats.len() - ok.len(),
            "ttft_ms": {"p50": percentile(&ttft, 50.0), "p90": percentile(&ttft, 90.0), "p99": percentile(&ttft, 99.0)},
            "mean_e2e_ms": mean_e2e,
            "throughput_rps": ok.len() as f64 / self.wall.as_secs_f64(),
            "prefix_cache_hit_ratio": self.hit_ratio,
            "load_imbalance": if mean_share > 0.0 { max_share / mean_share } else { 0.0 },
            "requests_per_gpu": self.served,
        })
    }
}

fn draw(
    results: &[PolicyResult],
    path: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (1200, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(480);
    let colors = [RED, BLUE, GREEN, BLACK];
    let max_ttft = results.iter().flat_map(|r| r.ttfts()).fold(1.0, f64::max);
    let mut cdf = ChartBuilder::on(&top)
        .caption("TTFT distribution per policy (CDF)", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((1f64..max_ttft * 1.1).log_scale(), 0f64..1f64)?;
    cdf.configure_mesh()
        .x_desc("time to first token (ms, log scale)")
        .y_desc("fraction of requests")
        .draw()?;
    for (r, color) in results.iter().zip(colors) {
        let t = r.ttfts();
        let n = t.len().max(1) as f64;
        cdf.draw_series(LineSeries::new(
            t.iter()
                .enumerate()
                .map(|(i, v)| (v.max(1.0), (i + 1) as f64 / n)),
            color.stroke_width(2),
        ))?
        .label(r.policy)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    cdf.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    let panels = bottom.split_evenly((1, results.len()));
    let max_load = results
        .iter()
        .flat_map(|r| r.load.iter().flat_map(|(_, row)| row.iter().copied()))
        .fold(1.0, f64::max);
    let max_t = results
        .iter()
        .flat_map(|r| r.load.last().map(|(t, _)| *t))
        .fold(1.0, f64::max);
    let gpu_colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    for (panel, r) in panels.iter().zip(results) {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{}: load per GPU", r.policy), ("sans-serif", 15))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(35)
            .build_cartesian_2d(0f64..max_t, 0f64..max_load * 1.05)?;
        chart
            .configure_mesh()
            .x_desc("s")
            .y_desc("running + waiting")
            .draw()?;
        for g in 0..GPUS {
            let color = gpu_colors[g % gpu_colors.len()];
            chart.draw_series(LineSeries::new(
                r.load.iter().map(|(t, row)| (*t, row[g])),
                color.stroke_width(1),
            ))?;
        }
    }
    root.present()?;
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes --bench; a filter argument selects policies.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let mut results = Vec::new();
    for policy in POLICIES {
        if !filter.is_empty() && !filter.iter().any(|f| policy.contains(f.as_str())) {
            continue;
        }
        eprintln!("running {policy} ...");
        results.push(run_policy(policy).await);
    }
    let summaries: Vec<serde_json::Value> = results.iter().map(PolicyResult::summary).collect();
    println!(
        "\n{GPUS} simulated GPUs, {SESSIONS} sessions, seed {SEED}, simulator speed {SPEED}x (times below are wall clock)\n"
    );
    println!(
        "{:<24} {:>8} {:>9} {:>9} {:>10} {:>9} {:>7} {:>9} {:>10}",
        "policy",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "mean e2e",
        "req/s",
        "errors",
        "cache hit",
        "imbalance"
    );
    for s in &summaries {
        println!(
            "{:<24} {:>6.0}ms {:>7.0}ms {:>7.0}ms {:>8.0}ms {:>9.1} {:>7} {:>8.1}% {:>10.2}",
            s["policy"].as_str().unwrap(),
            s["ttft_ms"]["p50"].as_f64().unwrap(),
            s["ttft_ms"]["p90"].as_f64().unwrap(),
            s["ttft_ms"]["p99"].as_f64().unwrap(),
            s["mean_e2e_ms"].as_f64().unwrap(),
            s["throughput_rps"].as_f64().unwrap(),
            s["errors"],
            s["prefix_cache_hit_ratio"].as_f64().unwrap() * 100.0,
            s["load_imbalance"].as_f64().unwrap(),
        );
    }
    let dir = out_dir();
    let detail: BTreeMap<&str, serde_json::Value> = results
        .iter()
        .map(|r| (r.policy, json!({"load": r.load.iter().map(|(t, row)| json!({"t": t, "per_gpu": row})).collect::<Vec<_>>()})))
        .collect();
    let out = json!({"gpus": GPUS, "sessions": SESSIONS, "seed": SEED, "speed": SPEED, "results": summaries, "load_over_time": detail});
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&out).unwrap(),
    )
    .unwrap();
    if let Err(e) = draw(&results, &dir.join("results.svg")) {
        eprintln!("could not draw the SVG: {e}");
    }
    println!("\nwrote {}/results.json and results.svg", dir.display());
}
