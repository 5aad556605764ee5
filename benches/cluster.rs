//! The cluster benchmark: prefixlb and the routers people would pick instead, in front of the
//! same simulated GPUs, on the same seeded workloads, side by side in one run.
//!
//! `cargo bench --bench cluster` prints a table per workload and writes `results.json` and
//! `results.svg` to `target/bench-results/` (or `$BENCH_OUT`), with every request's times in
//! `requests.csv` and prefixlb's access logs beside them: each request's `x-request-id` is
//! `<workload>-<session>-t<turn>`, so a log line tells which peer each turn went to. Arguments
//! filter: a workload name (`hot`, `chats`, `long`, `prompts`) or a router name keeps only
//! those.
//!
//! The routers: prefixlb (its default policy, with the key from the body and from a session
//! header; four processes in front of the same GPUs, told of each other and not;
//! `bounded_consistent_hash`), vllm-router `sticky_least_loaded` and `consistent_hash` with
//! the session header, sglang-router `cache_aware` (both from PyPI, into a venv the bench
//! makes), HAProxy `roundrobin` and `leastconn` (the Debian package). A router that cannot be installed is skipped with a line
//! saying why.
//!
//! Each run also gets a floor: the TTFT p99 no router could have gone below on its arrivals
//! (see [`ttft_floors`]), printed with prefixlb's verdict, so that a target under it reads as
//! out of reach rather than missed.
//!
//! The workloads, all streamed, sessions resending their whole history every turn and thinking
//! between turns:
//! - `hot`: six departments, each with its long system prompt; one has half of all sessions
//!   (hundreds of doctors on one prompt) and sends the whole conversation as one completions
//!   prompt, whose key (its first 2048 characters) is the shared template: one hot key. A third
//!   of the sessions arrive in a burst at the start.
//! - `chats`: many independent chats, each with its own system prompt, arriving at random.
//! - `long`: bursts of sessions asking about one of four long documents (20 to 62 KB, the
//!   largest near the 64 KiB peek limit).
//! - `prompts`: raw-prompt traffic on six GPUs: three departments, each with a 6,000-token
//!   system prompt (seven sessions in ten in one of them), sessions of five turns sent as one
//!   growing `/v1/completions` prompt, a burst of thirty at the start.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::peers::{start_haproxy, start_sglang_router, start_vllm_router};
use common::*;
use futures_util::StreamExt;
use plotters::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

/// Requests each simulated GPU runs at once; more wait in its queue.
const MAX_RUNNING: usize = 8;
const CACHE_TOKENS: usize = 65_536;
const SPEED: f64 = 2.0;
/// The simulator's prefill rate at `SPEED`: what an operator would configure.
const PREFILL_TOKENS_PER_SEC: f64 = 10_000.0 * SPEED;
const MAX_IN_FLIGHT: u32 = 32;
const REPLICAS: usize = 4;
const SEED: u64 = 20261201;
const SESSION_HEADER: &str = "x-session-id";

#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape {
    Hot,
    Chats,
    Long,
    Prompts,
}

const SHAPES: [Shape; 4] = [Shape::Hot, Shape::Chats, Shape::Long, Shape::Prompts];

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Hot => "hot",
            Shape::Chats => "chats",
            Shape::Long => "long",
            Shape::Prompts => "prompts",
        }
    }

    fn gpus(self) -> usize {
        match self {
            Shape::Prompts => 6,
            _ => 4,
        }
    }
}

struct Turn {
    user: String,
    think: Duration,
    max_tokens: usize,
}

struct Session {
    start: Duration,
    /// Chat messages, or one growing completions prompt.
    chat: bool,
    system: Arc<str>,
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

/// Exponential, with this mean.
fn think(rng: &mut StdRng, mean_secs: f64) -> Duration {
    Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() * mean_secs)
}

fn turns(
    rng: &mut StdRng,
    count: std::ops::Range<usize>,
    chars: std::ops::Range<usize>,
) -> Vec<Turn> {
    (0..rng.random_range(count))
        .map(|_| Turn {
            user: words(rng, chars.clone()),
            think: think(rng, 1.2),
            max_tokens: rng.random_range(24..72),
        })
        .collect()
}

/// The system prompts of `n` departments, each `chars` long.
fn departments(rng: &mut StdRng, n: usize, chars: std::ops::Range<usize>) -> Vec<Arc<str>> {
    (0..n)
        .map(|d| {
            let protocol = words(rng, chars.clone());
            format!("You are the assistant of department {d}. Protocol: {protocol}").into()
        })
        .collect()
}

/// A session's department of `n`: the first with probability `hot`, else any other.
fn department(rng: &mut StdRng, n: usize, hot: f64) -> usize {
    if rng.random_bool(hot) {
        0
    } else {
        rng.random_range(1..n)
    }
}

fn workload(shape: Shape) -> Vec<Session> {
    let mut rng = StdRng::seed_from_u64(SEED ^ shape as u64);
    match shape {
        Shape::Hot => {
            let prompts = departments(&mut rng, 6, 2500..5000);
            (0..120)
                .map(|i| {
                    let dept = department(&mut rng, 6, 0.5);
                    let start = if i % 3 == 0 {
                        Duration::from_millis(rng.random_range(0..1500))
                    } else {
                        Duration::from_millis(rng.random_range(0..15_000))
                    };
                    Session {
                        start,
                        chat: dept != 0,
                        system: Arc::clone(&prompts[dept]),
                        turns: turns(&mut rng, 4..9, 600..2400),
                    }
                })
                .collect()
        }
        Shape::Chats => (0..160)
            .map(|i| Session {
                start: Duration::from_millis(rng.random_range(0..20_000)),
                chat: true,
                system: format!("You are assistant {i}. {}", words(&mut rng, 400..1600)).into(),
                turns: turns(&mut rng, 3..9, 200..1200),
            })
            .collect(),
        Shape::Long => {
            let docs: Vec<Arc<str>> = [20_000, 36_000, 52_000, 62_000]
                .iter()
                .enumerate()
                .map(|(d, &len)| {
                    format!(
                        "Answer from document {d}: {}",
                        words(&mut rng, len..len + 1)
                    )
                    .into()
                })
                .collect();
            (0..60)
                .map(|i| Session {
                    start: Duration::from_millis(
                        (i / 20) as u64 * 6_000 + rng.random_range(0..500),
                    ),
                    chat: true,
                    system: Arc::clone(&docs[rng.random_range(0..docs.len())]),
                    turns: turns(&mut rng, 2..5, 200..800),
                })
                .collect()
        }
        Shape::Prompts => {
            let prompts = departments(&mut rng, 3, 24_000..24_001);
            (0..80)
                .map(|i| {
                    let dept = department(&mut rng, 3, 0.7);
                    let start = if i < 30 {
                        Duration::from_millis(rng.random_range(0..1000))
                    } else {
                        Duration::from_millis(rng.random_range(1000..20_000))
                    };
                    Session {
                        start,
                        chat: false,
                        system: Arc::clone(&prompts[dept]),
                        turns: turns(&mut rng, 5..6, 300..1500),
                    }
                })
                .collect()
        }
    }
}

/// The least TTFT each request could have had, whatever the router: the part of its prompt
/// that could not have been prefilled anywhere by the time it came, at the simulator's prefill
/// rate. GPUs are taken as unlimited and idle and caches as keeping everything, so it is a
/// floor, not an estimate. A prefix is cached at the earliest once the first request that
/// carried it has prefilled what no request before that one carried: two readers of one cold
/// document in a burst both wait out most of its prefill.
fn ttft_floors(stats: &[Stat]) -> Vec<f64> {
    let chars_per_ms = PREFILL_TOKENS_PER_SEC * 4.0 / 1000.0;
    let mut order: Vec<&Stat> = stats.iter().collect();
    order.sort_by_key(|s| s.sent);
    let at = |s: &Stat| s.sent.as_secs_f64() * 1000.0;
    // How much of each prompt some request sent before it carried.
    let mut carried = vec![0usize; order.len()];
    let mut floors = Vec::with_capacity(order.len());
    for (i, s) in order.iter().enumerate() {
        let mine = s.prompt.as_bytes();
        let shared: Vec<usize> = order[..i]
            .iter()
            .map(|e| common_prefix(mine, e.prompt.as_bytes()))
            .collect();
        // reach[j]: the longest prefix of this prompt carried by request j or one before it.
        let reach: Vec<usize> = shared
            .iter()
            .scan(0, |most, &l| {
                *most = l.max(*most);
                Some(*most)
            })
            .collect();
        carried[i] = reach.last().copied().unwrap_or(0);
        let mut best = mine.len() as f64 / chars_per_ms;
        for &c in &shared {
            let first = reach.partition_point(|&r| r < c);
            let cached_at =
                at(order[first]) + c.saturating_sub(carried[first]) as f64 / chars_per_ms;
            let own = (mine.len() - c) as f64 / chars_per_ms;
            best = best.min((cached_at - at(s)).max(0.0) + own);
        }
        floors.push(best);
    }
    floors
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 64 <= n && a[i..i + 64] == b[i..i + 64] {
        i += 64;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// What the simulator answers to `n` tokens: the history every next turn carries.
fn answer(n: usize) -> String {
    (0..n).map(|i| format!("tok{i} ")).collect()
}

#[derive(Clone)]
struct Stat {
    session: usize,
    turn: usize,
    /// When it was sent, from the start of the run.
    sent: Duration,
    /// Its prompt as the simulator reads it (a chat's messages as `role: content` lines).
    prompt: Arc<str>,
    ttft_ms: f64,
    e2e_ms: f64,
    ok: bool,
}

/// Where clients send: one address, or several taken in turn.
struct Entry {
    addrs: Vec<SocketAddr>,
    next: AtomicUsize,
}

impl Entry {
    fn pick(&self) -> SocketAddr {
        self.addrs[self.next.fetch_add(1, Ordering::Relaxed) % self.addrs.len()]
    }
}

/// Where a session sends, and what it is called.
struct Client {
    http: reqwest::Client,
    entry: Arc<Entry>,
    /// The session header's value, for routers that get one.
    session_id: Option<String>,
    /// `<workload>-<session>`: with the turn, each request's `x-request-id`, which prefixlb
    /// logs beside the peer it chose.
    name: String,
    /// The run's start.
    epoch: Instant,
}

async fn run_session(c: Client, index: usize, s: Session, stats: Arc<Mutex<Vec<Stat>>>) {
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
                json!({"model": "m", "stream": true, "max_tokens": t.max_tokens, "messages": messages}),
            )
        } else {
            text.push_str(&format!("Doctor: {}\nAssistant: ", t.user));
            (
                format!("http://{lb}/v1/completions"),
                json!({"model": "m", "stream": true, "max_tokens": t.max_tokens, "prompt": text}),
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

#[derive(Debug, Clone, Copy, PartialEq)]
enum Router {
    Prefixlb {
        policy: &'static str,
        replicas: usize,
        header: bool,
        /// `routing.shared_prefix_placement`.
        placement: bool,
        /// Whether the replicas tell each other where prompts went (`replicas:`).
        exchange: bool,
    },
    Vllm(&'static str),
    Sglang(&'static str),
    Haproxy(&'static str),
}

const ROUTERS: [Router; 11] = [
    Router::Prefixlb {
        policy: "least_cost",
        replicas: 1,
        header: false,
        placement: false,
        exchange: false,
    },
    Router::Prefixlb {
        policy: "least_cost",
        replicas: 1,
        header: false,
        placement: true,
        exchange: false,
    },
    Router::Prefixlb {
        policy: "least_cost",
        replicas: 1,
        header: true,
        placement: false,
        exchange: false,
    },
    Router::Prefixlb {
        policy: "least_cost",
        replicas: REPLICAS,
        header: false,
        placement: false,
        exchange: true,
    },
    Router::Prefixlb {
        policy: "least_cost",
        replicas: REPLICAS,
        header: false,
        placement: false,
        exchange: false,
    },
    Router::Prefixlb {
        policy: "bounded_consistent_hash",
        replicas: 1,
        header: false,
        placement: false,
        exchange: false,
    },
    Router::Vllm("sticky_least_loaded"),
    Router::Vllm("consistent_hash"),
    Router::Sglang("cache_aware"),
    Router::Haproxy("roundrobin"),
    Router::Haproxy("leastconn"),
];

impl Router {
    fn name(self) -> String {
        match self {
            Router::Prefixlb {
                policy,
                replicas,
                header,
                placement,
                exchange,
            } => {
                let key = if header { ", session header" } else { "" };
                let key = if placement {
                    format!("{key}, shared-prefix placement")
                } else {
                    key.to_owned()
                };
                let n = match (replicas, exchange) {
                    (1, _) => String::new(),
                    (n, true) => format!(" ×{n}"),
                    (n, false) => format!(" ×{n} apart"),
                };
                format!("prefixlb {policy}{n}{key}")
            }
            Router::Vllm(p) => format!("vllm-router {p}, session header"),
            Router::Sglang(p) => format!("sglang-router {p}"),
            Router::Haproxy(b) => format!("haproxy {b}"),
        }
    }

    fn is_peer(self) -> bool {
        !matches!(self, Router::Prefixlb { .. })
    }

    fn sends_header(self) -> bool {
        match self {
            Router::Prefixlb { header, .. } => header,
            // Its sticky policies key on the header; without one, chat requests all hash alike.
            Router::Vllm(_) => true,
            Router::Sglang(_) | Router::Haproxy(_) => false,
        }
    }

    /// Starts the router in front of `gpus`: where clients send, and what keeps it running.
    async fn start(self, gpus: &[SocketAddr]) -> Result<(Vec<SocketAddr>, Running), String> {
        match self {
            Router::Prefixlb {
                policy,
                replicas,
                placement,
                exchange,
                ..
            } => {
                let config = TestConfig::new()
                    .peers_at(gpus.iter().copied())
                    .max_in_flight(MAX_IN_FLIGHT)
                    .policy(policy)
                    .prefill_tokens_per_second(PREFILL_TOKENS_PER_SEC)
                    .shared_prefix_placement(placement)
                    .no_health_check()
                    .engine_metrics(true);
                let told = if exchange {
                    common::replicas(replicas).into_iter().map(Some).collect()
                } else {
                    vec![None; replicas]
                };
                let mut proxies = Vec::new();
                for told in told {
                    let config = match told {
                        Some(replica) => config.clone().replica(&replica),
                        None => config.clone(),
                    };
                    // The access log stays on, as by default: its cost is part of what is
                    // measured.
                    proxies.push(start_proxy(&config).await);
                }
                let addrs = proxies.iter().map(|p| p.addr).collect();
                Ok((addrs, Running::Prefixlb(proxies)))
            }
            Router::Vllm(policy) => {
                let (addr, child) = start_vllm_router(gpus, policy).await?;
                Ok((vec![addr], Running::Other(child)))
            }
            Router::Sglang(policy) => {
                let (addr, child) = start_sglang_router(gpus, policy).await?;
                Ok((vec![addr], Running::Other(child)))
            }
            Router::Haproxy(balance) => {
                let (addr, child) = start_haproxy(gpus, balance, false, 4096, "").await?;
                Ok((vec![addr], Running::Other(child)))
            }
        }
    }
}

enum Running {
    Prefixlb(Vec<Proxy>),
    /// Held only to be stopped when dropped.
    Other(#[allow(dead_code)] common::peers::Killed),
}

impl Running {
    fn access_log(&self) -> String {
        match self {
            Running::Prefixlb(proxies) => proxies.iter().map(Proxy::access_log).collect(),
            Running::Other(_) => String::new(),
        }
    }

    /// How prefixlb chose its peers, summed over its processes: requests per route.
    async fn routes(&self) -> BTreeMap<String, f64> {
        let mut routes = BTreeMap::new();
        let Running::Prefixlb(proxies) = self else {
            return routes;
        };
        for p in proxies {
            for line in p.metrics().await.lines() {
                let Some(rest) = line.strip_prefix("prefixlb_peer_requests_total{") else {
                    continue;
                };
                let route = rest
                    .split("route=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next());
                let value = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
                if let (Some(route), Some(value)) = (route, value) {
                    *routes.entry(route.to_owned()).or_default() += value;
                }
            }
        }
        routes
    }
}

struct RunResult {
    shape: Shape,
    router: Router,
    stats: Vec<Stat>,
    wall: Duration,
    hit_ratio: f64,
    served: Vec<f64>,
    /// The most requests (running and waiting) any GPU held at one sample.
    peak_load: f64,
    /// prefixlb's requests by route (primary, overflow, replica).
    routes: BTreeMap<String, f64>,
    /// (seconds, running + waiting per GPU)
    load: Vec<(f64, Vec<f64>)>,
    /// prefixlb's access log, its processes' one after another: the peer each request went to.
    access_log: String,
}

async fn scrape(c: &reqwest::Client, gpu: SocketAddr) -> String {
    match c.get(format!("http://{gpu}/metrics")).send().await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

async fn run(shape: Shape, router: Router) -> Result<RunResult, String> {
    let sim_args: Vec<String> = [
        "--speed".to_owned(),
        SPEED.to_string(),
        "--cache-tokens".to_owned(),
        CACHE_TOKENS.to_string(),
        "--max-running".to_owned(),
        MAX_RUNNING.to_string(),
    ]
    .to_vec();
    let (_sims, gpus) = start_sims(shape.gpus(), &sim_args).await;
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
    let tasks: Vec<_> = workload(shape)
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
    let access_log = running.access_log();
    let (mut hits, mut queries, mut served) = (0.0, 0.0, Vec::new());
    for g in &gpus {
        let m = scrape(&c, *g).await;
        hits += sample(&m, "vllm:prefix_cache_hits_total");
        queries += sample(&m, "vllm:prefix_cache_queries_total");
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
        stats,
        wall,
        hit_ratio: if queries > 0.0 { hits / queries } else { 0.0 },
        served,
        peak_load,
        routes,
        load,
        access_log,
    })
}

impl RunResult {
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

    fn p(&self, q: f64) -> f64 {
        percentile(&self.ttfts(), q)
    }

    /// The TTFT percentile `q` that no router could have gone below on this run's arrivals.
    fn floor(&self, q: f64) -> f64 {
        let mut v = ttft_floors(&self.stats);
        v.sort_by(f64::total_cmp);
        percentile(&v, q)
    }

    /// The least-served GPU's requests over the mean: how far below its share one fell.
    fn lowest_share(&self) -> f64 {
        let mean = self.served.iter().sum::<f64>() / self.served.len().max(1) as f64;
        let least = self.served.iter().copied().fold(f64::MAX, f64::min);
        if mean > 0.0 {
            least / mean
        } else {
            0.0
        }
    }

    fn errors(&self) -> usize {
        self.stats.iter().filter(|s| !s.ok).count()
    }

    fn summary(&self) -> serde_json::Value {
        let ok: Vec<&Stat> = self.stats.iter().filter(|s| s.ok).collect();
        let mean_e2e = ok.iter().map(|s| s.e2e_ms).sum::<f64>() / ok.len().max(1) as f64;
        let total: f64 = self.served.iter().sum();
        let mean_share = total / self.served.len() as f64;
        let max_share = self.served.iter().copied().fold(0.0, f64::max);
        json!({
            "workload": self.shape.name(),
            "router": self.router.name(),
            "gpus": self.served.len(),
            "requests": self.stats.len(),
            "errors": self.errors(),
            "ttft_ms": {"p50": self.p(50.0), "p90": self.p(90.0), "p99": self.p(99.0)},
            "ttft_p99_floor_ms": self.floor(99.0),
            "mean_e2e_ms": mean_e2e,
            "throughput_rps": ok.len() as f64 / self.wall.as_secs_f64(),
            "prefix_cache_hit_ratio": self.hit_ratio,
            "load_imbalance": if mean_share > 0.0 { max_share / mean_share } else { 0.0 },
            "peak_gpu_load": self.peak_load,
            "prefixlb_routes": self.routes,
            "requests_per_gpu": self.served,
        })
    }
}

fn print_table(shape: Shape, results: &[&RunResult]) {
    println!(
        "\n{}: {} simulated GPUs ({MAX_RUNNING} running each), seed {SEED}, simulator speed {SPEED}x (times are wall clock)\n",
        shape.name(),
        shape.gpus()
    );
    println!(
        "{:<48} {:>8} {:>9} {:>9} {:>10} {:>7} {:>9} {:>9} {:>9}  routes",
        "router",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "mean e2e",
        "errors",
        "cache hit",
        "imbalance",
        "peak load"
    );
    for r in results {
        let s = r.summary();
        let total: f64 = r.routes.values().sum();
        let routes: Vec<String> = r
            .routes
            .iter()
            .map(|(k, v)| format!("{k} {:.0}%", v / total * 100.0))
            .collect();
        println!(
            "{:<48} {:>6.0}ms {:>7.0}ms {:>7.0}ms {:>8.0}ms {:>7} {:>8.1}% {:>9.2} {:>9.0}  {}",
            r.router.name(),
            r.p(50.0),
            r.p(90.0),
            r.p(99.0),
            s["mean_e2e_ms"].as_f64().unwrap(),
            r.errors(),
            r.hit_ratio * 100.0,
            s["load_imbalance"].as_f64().unwrap(),
            r.peak_load,
            routes.join(", "),
        );
    }
}

/// How often prefixlb sent a turn away from the peer of the turn before, and what those turns'
/// first tokens cost against the turns that stayed, from its access log.
fn moves(r: &RunResult) -> Option<String> {
    // (session, turn) -> (peer, ttft)
    let mut turns = BTreeMap::new();
    for line in r.access_log.lines() {
        let field = |name: &str| {
            line.split(' ')
                .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
        };
        let (Some(peer), Some(id), Some(ttft)) =
            (field("peer"), field("request_id"), field("ttft_ms"))
        else {
            continue;
        };
        let Some((session, turn)) = id.rsplit_once("-t") else {
            continue;
        };
        if let (Ok(turn), Ok(ttft)) = (turn.parse::<usize>(), ttft.parse::<f64>()) {
            turns.insert((session.to_owned(), turn), (peer.to_owned(), ttft));
        }
    }
    let (mut moved, mut stayed) = (Vec::new(), Vec::new());
    for ((session, turn), (peer, ttft)) in &turns {
        let Some(before) = turn
            .checked_sub(1)
            .and_then(|t| turns.get(&(session.clone(), t)))
        else {
            continue;
        };
        if before.0 == *peer {
            &mut stayed
        } else {
            &mut moved
        }
        .push(*ttft);
    }
    if moved.is_empty() && stayed.is_empty() {
        return None;
    }
    moved.sort_by(f64::total_cmp);
    stayed.sort_by(f64::total_cmp);
    Some(format!(
        "{}: {}: {} of {} later turns left the peer of the turn before (TTFT p50 {:.0} ms, p90 {:.0} ms; those that stayed {:.0} / {:.0} ms)",
        r.shape.name(),
        r.router.name(),
        moved.len(),
        moved.len() + stayed.len(),
        percentile(&moved, 50.0),
        percentile(&moved, 90.0),
        percentile(&stayed, 50.0),
        percentile(&stayed, 90.0),
    ))
}

/// How prefixlb's default policy compares with the best of the peers on one workload, as the
/// routing issue asks: p50 within 5% of the best, p99 at most 0.8 of the best, hits at least
/// the best of the peers that do not melt (p99 within 2 × the best) minus one point, no errors;
/// on `prompts`, as the block-record issue adds, no GPU below half of the mean share.
fn verdict(shape: Shape, results: &[&RunResult]) -> Vec<String> {
    let peers: Vec<&&RunResult> = results.iter().filter(|r| r.router.is_peer()).collect();
    if peers.is_empty() {
        return Vec::new();
    }
    let best_p50 = peers.iter().map(|r| r.p(50.0)).fold(f64::MAX, f64::min);
    let best_p99 = peers.iter().map(|r| r.p(99.0)).fold(f64::MAX, f64::min);
    let best_hits = peers
        .iter()
        .filter(|r| r.p(99.0) <= 2.0 * best_p99)
        .map(|r| r.hit_ratio)
        .fold(0.0, f64::max);
    let mut lines = Vec::new();
    for r in results.iter().filter(|r| {
        matches!(
            r.router,
            Router::Prefixlb {
                policy: "least_cost",
                replicas: 1,
                ..
            }
        )
    }) {
        let p50 = r.p(50.0) / best_p50;
        let p99 = r.p(99.0) / best_p99;
        let hits = (r.hit_ratio - best_hits) * 100.0;
        let lowest = r.lowest_share();
        let spread = shape != Shape::Prompts || lowest >= 0.5;
        let met = p50 <= 1.05 && p99 <= 0.8 && hits >= -1.0 && r.errors() == 0 && spread;
        // Below the floor of its own arrivals no router could go: a p99 target under it is
        // out of reach on this run, whatever the routing.
        let floor = r.floor(99.0);
        let reach = if floor > 0.8 * best_p99 {
            format!(", out of reach: the arrivals' p99 floor is {floor:.0} ms, 0.8× the best peer's {:.0} ms", 0.8 * best_p99)
        } else {
            format!(", p99 floor {floor:.0} ms")
        };
        lines.push(format!(
            "{}: {}: p50 {p50:.2}× the best peer's, p99 {p99:.2}×{reach}, hits {hits:+.1} points, {} errors, least-served GPU {lowest:.2}× the mean: {}",
            shape.name(),
            r.router.name(),
            r.errors(),
            if met { "meets the targets" } else { "misses" }
        ));
    }
    // Replicas against one process, key from the body.
    let one = results.iter().find(|r| {
        r.router
            == Router::Prefixlb {
                policy: "least_cost",
                replicas: 1,
                header: false,
                placement: false,
                exchange: false,
            }
    });
    let many = results
        .iter()
        .filter(|r| matches!(r.router, Router::Prefixlb { replicas, .. } if replicas > 1));
    for many in many {
        let Some(one) = one else { break };
        lines.push(format!(
            "{}: {}: hits {:.3}× one process's, p50 {:.2}×, p99 {:.2}×, peak GPU load {:.0} (max_in_flight {MAX_IN_FLIGHT})",
            shape.name(),
            many.router.name(),
            many.hit_ratio / one.hit_ratio.max(1e-9),
            many.p(50.0) / one.p(50.0),
            many.p(99.0) / one.p(99.0),
            many.peak_load,
        ));
    }
    lines
}

fn draw(results: &[RunResult], path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let shapes: Vec<Shape> = SHAPES
        .into_iter()
        .filter(|s| results.iter().any(|r| r.shape == *s))
        .collect();
    let root = SVGBackend::new(path, (1500, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let colors = [
        RED,
        RGBColor(255, 140, 0),
        RGBColor(180, 0, 120),
        RGBColor(120, 120, 120),
        BLUE,
        CYAN,
        GREEN,
        BLACK,
        RGBColor(140, 90, 40),
    ];
    for (panel, shape) in root
        .split_evenly((1, shapes.len().max(1)))
        .iter()
        .zip(&shapes)
    {
        let runs: Vec<&RunResult> = results.iter().filter(|r| r.shape == *shape).collect();
        let max_ttft = runs.iter().flat_map(|r| r.ttfts()).fold(1.0, f64::max);
        let mut cdf = ChartBuilder::on(panel)
            .caption(format!("{}: TTFT (CDF)", shape.name()), ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(40)
            .build_cartesian_2d((5f64..max_ttft * 1.1).log_scale(), 0f64..1f64)?;
        cdf.configure_mesh()
            .x_desc("ms, log scale")
            .y_desc("fraction of requests")
            .draw()?;
        for r in runs {
            let color =
                colors[ROUTERS.iter().position(|x| *x == r.router).unwrap_or(0) % colors.len()];
            let t = r.ttfts();
            let n = t.len().max(1) as f64;
            cdf.draw_series(LineSeries::new(
                t.iter()
                    .enumerate()
                    .map(|(i, v)| (v.max(5.0), (i + 1) as f64 / n)),
                color.stroke_width(2),
            ))?
            .label(r.router.name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
        cdf.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes --bench; other arguments filter workloads and routers.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let shape_filter: Vec<&String> = filter
        .iter()
        .filter(|f| SHAPES.iter().any(|s| s.name() == f.as_str()))
        .collect();
    let router_filter: Vec<&String> = filter
        .iter()
        .filter(|f| !shape_filter.contains(f))
        .collect();
    let mut results = Vec::new();
    let mut skipped: BTreeMap<String, String> = BTreeMap::new();
    for shape in SHAPES {
        if !shape_filter.is_empty() && !shape_filter.iter().any(|f| *f == shape.name()) {
            continue;
        }
        for router in ROUTERS {
            let name = router.name();
            if !router_filter.is_empty() && !router_filter.iter().any(|f| name.contains(f.as_str()))
            {
                continue;
            }
            if skipped.contains_key(&name) {
                continue;
            }
            eprintln!("{}: running {name} ...", shape.name());
            match run(shape, router).await {
                Ok(r) => results.push(r),
                Err(why) => {
                    println!("skipped {name}: {why}");
                    skipped.insert(name, why);
                }
            }
        }
    }
    let mut verdicts = Vec::new();
    let mut departures = Vec::new();
    for shape in SHAPES {
        let runs: Vec<&RunResult> = results.iter().filter(|r| r.shape == shape).collect();
        if runs.is_empty() {
            continue;
        }
        print_table(shape, &runs);
        verdicts.extend(verdict(shape, &runs));
        departures.extend(runs.iter().filter_map(|r| moves(r)));
    }
    println!();
    for v in &verdicts {
        println!("{v}");
    }
    println!();
    for d in &departures {
        println!("{d}");
    }
    let dir = out_dir();
    let summaries: Vec<serde_json::Value> = results.iter().map(RunResult::summary).collect();
    let load: Vec<serde_json::Value> = results
        .iter()
        .map(|r| {
            json!({
                "workload": r.shape.name(),
                "router": r.router.name(),
                "load": r.load.iter().map(|(t, row)| json!({"t": t, "per_gpu": row})).collect::<Vec<_>>(),
            })
        })
        .collect();
    let out = json!({
        "max_running": MAX_RUNNING, "cache_tokens": CACHE_TOKENS, "seed": SEED,
        "speed": SPEED, "results": summaries, "verdicts": verdicts, "skipped": skipped,
        "load_over_time": load,
    });
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&out).unwrap(),
    )
    .unwrap();
    let mut requests = String::from("workload,router,session,turn,sent_ms,ttft_ms,e2e_ms,ok\n");
    for r in &results {
        for s in &r.stats {
            requests.push_str(&format!(
                "{},\"{}\",{},{},{:.1},{:.1},{:.1},{}\n",
                r.shape.name(),
                r.router.name(),
                s.session,
                s.turn,
                s.sent.as_secs_f64() * 1000.0,
                s.ttft_ms,
                s.e2e_ms,
                s.ok
            ));
        }
        if !r.access_log.is_empty() {
            let slug: String = r
                .router
                .name()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            let path = dir.join(format!("access-{}-{slug}.log", r.shape.name()));
            std::fs::write(path, &r.access_log).unwrap();
        }
    }
    std::fs::write(dir.join("requests.csv"), requests).unwrap();
    if let Err(e) = draw(&results, &dir.join("results.svg")) {
        eprintln!("could not draw the SVG: {e}");
    }
    println!(
        "\nwrote {}/results.json, results.svg, requests.csv and prefixlb's access logs",
        dir.display()
    );
}
