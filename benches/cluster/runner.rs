//! One run: the simulated GPUs, a router in front of them, every session of a workload sent
//! through it, and what the GPUs and the router counted.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::json;

use crate::common::*;
use crate::routers::Router;
use crate::setup::{SimModel, MODEL_NAME, SESSION_HEADER, SPEED};
use crate::workload::{workload, Session, Shape};

/// What the simulator answers to `n` tokens: the history every next turn carries.
pub fn answer(n: usize) -> String {
    (0..n).map(|i| format!("tok{i} ")).collect()
}

#[derive(Clone)]
pub struct Stat {
    pub session: usize,
    pub turn: usize,
    /// When it was sent, from the start of the run.
    pub sent: Duration,
    /// Its prompt as the simulator reads it (a chat's messages as `role: content` lines).
    pub prompt: Arc<str>,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    pub ok: bool,
}

/// Where clients send: one address, or several taken in turn.
pub struct Entry {
    pub addrs: Vec<SocketAddr>,
    pub next: AtomicUsize,
}

impl Entry {
    pub fn pick(&self) -> SocketAddr {
        self.addrs[self.next.fetch_add(1, Ordering::Relaxed) % self.addrs.len()]
    }
}

/// Where a session sends, and what it is called.
pub struct Client {
    pub http: reqwest::Client,
    pub entry: Arc<Entry>,
    /// The session header's value, for routers that get one.
    pub session_id: Option<String>,
    /// `<workload>-<session>`: with the turn, each request's `x-request-id`, which prefixlb
    /// logs beside the peer it chose.
    pub name: String,
    /// The run's start.
    pub epoch: Instant,
}

/// Every client asks for the usage of its streams, as OpenAI's clients do to count tokens: it
/// tells the routers that read it (prefixlb) what the engine had cached.
fn usage() -> serde_json::Value {
    json!({"include_usage": true})
}

pub async fn run_session(c: Client, index: usize, s: Session, stats: Arc<Mutex<Vec<Stat>>>) {
    tokio::time::sleep(s.start.div_f64(SPEED)).await;
    let mut messages = vec![json!({"role": "system", "content": &*s.system})];
    let mut text = format!("{}\n", s.system);
    let mut lines = format!("system: {}\n", s.system);
    for (turn, t) in s.turns.into_iter().enumerate() {
        let lb = c.entry.pick();
        let (url, body) = if s.chat {
            messages.push(json!({"role": "user", "content": t.user}));
            lines.push_str(&format!("user: {}\n", t.user));
            (
                format!("http://{lb}/v1/chat/completions"),
                json!({"model": MODEL_NAME, "stream": true, "stream_options": usage(), "max_tokens": t.max_tokens, "messages": messages}),
            )
        } else {
            text.push_str(&format!("Doctor: {}\nAssistant: ", t.user));
            (
                format!("http://{lb}/v1/completions"),
                json!({"model": MODEL_NAME, "stream": true, "stream_options": usage(), "max_tokens": t.max_tokens, "prompt": text}),
            )
        };
        let prompt: Arc<str> = if s.chat { &lines } else { &text }.as_str().into();
        let start = Instant::now();
        let mut ttft = None;
        let ok = async {
            let mut req = c
                .http
                .post(&url)
                .header("x-request-id", format!("{}-t{turn}", c.name))
                .json(&body);
            if let Some(id) = &c.session_id {
                req = req.header(SESSION_HEADER, id);
            }
            let r = req.send().await.ok()?;
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
            session: index,
            turn,
            sent: start.duration_since(c.epoch),
            prompt,
            ttft_ms: ttft.unwrap_or(e2e).as_secs_f64() * 1000.0,
            e2e_ms: e2e.as_secs_f64() * 1000.0,
            ok,
        });
        let reply = answer(t.max_tokens);
        if s.chat {
            lines.push_str(&format!("assistant: {reply}\n"));
            messages.push(json!({"role": "assistant", "content": reply}));
        } else {
            text.push_str(&reply);
            text.push('\n');
        }
        tokio::time::sleep(t.think.div_f64(SPEED)).await;
    }
}

pub struct RunResult {
    pub shape: Shape,
    pub router: Router,
    pub model: SimModel,
    pub seed: u64,
    /// Which of the command's `runs=N` repeats it belongs to, from 0.
    pub run: usize,
    pub stats: Vec<Stat>,
    pub wall: Duration,
    pub hit_ratio: f64,
    /// Cached prefix blocks the GPUs evicted, and running requests they preempted (engine
    /// model only).
    pub evictions: f64,
    pub preemptions: f64,
    pub served: Vec<f64>,
    /// The most requests (running and waiting) any GPU held at one sample.
    pub peak_load: f64,
    /// prefixlb's requests by route (primary, overflow, replica).
    pub routes: BTreeMap<String, f64>,
    /// (seconds, running + waiting per GPU)
    pub load: Vec<(f64, Vec<f64>)>,
    /// prefixlb's access log, its processes' one after another: the peer each request went to.
    pub access_log: String,
}

pub async fn scrape(c: &reqwest::Client, gpu: SocketAddr) -> String {
    match c.get(format!("http://{gpu}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

pub async fn run(
    shape: Shape,
    router: Router,
    model: SimModel,
    seed: u64,
) -> Result<RunResult, String> {
    let (_sims, gpus) = start_sims(shape.gpus(), &model.sim_args(shape.gpus())).await;
    let (addrs, running) = router.start(&gpus).await?;
    let entry = Arc::new(Entry {
        addrs,
        next: AtomicUsize::new(0),
    });
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(64)
        .build()
        .unwrap();
    let stats = Arc::new(Mutex::new(Vec::new()));
    let start = Instant::now();
    let tasks: Vec<_> = workload(shape, seed)
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let name = format!("{}-{i}", shape.name());
            let client = Client {
                http: c.clone(),
                entry: Arc::clone(&entry),
                session_id: router.sends_header().then(|| name.clone()),
                name,
                epoch: start,
            };
            tokio::spawn(run_session(client, i, s, Arc::clone(&stats)))
        })
        .collect();
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (c, gpus, done) = (c.clone(), gpus.clone(), Arc::clone(&done));
        tokio::spawn(async move {
            let mut load = Vec::new();
            while !done.load(Ordering::SeqCst) {
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
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            load
        })
    };
    for t in tasks {
        t.await.unwrap();
    }
    let wall = start.elapsed();
    done.store(true, Ordering::SeqCst);
    let load = sampler.await.unwrap_or_default();
    let routes = running.routes().await;
    let sent = stats.lock().unwrap().len();
    let access_log = running.access_log(sent).await;
    running.keep_log(&format!(
        "{} {} {} {seed}",
        router.name(),
        shape.name(),
        model.name()
    ));
    let (mut hits, mut queries, mut served) = (0.0, 0.0, Vec::new());
    let (mut evictions, mut preemptions) = (0.0, 0.0);
    for g in &gpus {
        let m = scrape(&c, *g).await;
        hits += sample(&m, "vllm:prefix_cache_hits_total");
        queries += sample(&m, "vllm:prefix_cache_queries_total");
        evictions += sample(&m, "gpu_sim:prefix_cache_evictions_total");
        preemptions += sample(&m, "vllm:num_preemptions_total");
        served.push(sample(&m, "vllm:request_success_total"));
    }
    let stats = stats.lock().unwrap().clone();
    let peak_load = load
        .iter()
        .flat_map(|(_, row)| row.iter().copied())
        .fold(0.0, f64::max);
    Ok(RunResult {
        shape,
        router,
        model,
        seed,
        run: 0,
        stats,
        wall,
        hit_ratio: if queries > 0.0 { hits / queries } else { 0.0 },
        evictions,
        preemptions,
        served,
        peak_load,
        routes,
        load,
        access_log,
    })
}
