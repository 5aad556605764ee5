//! One router's pass: engines with cold caches, the router in front, every session played
//! against it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::llama::{Setup, MODEL};
use crate::routers::Router;
use crate::setup::SESSION_HEADER;
use crate::stream;
use crate::vllm;
use crate::workload::{Session, Workload, MAX_TOKENS};

/// One turn as the client saw it; `None` when it failed.
pub struct Turn {
    pub ttft: Duration,
    pub e2e: Duration,
    pub prompt: u64,
    pub cached: u64,
}

pub struct Pass {
    pub turns: Vec<Option<Turn>>,
    pub wall: Duration,
    /// What each engine's own counters say of the pass: where the prompt tokens went, and
    /// how many of them each found cached.
    pub engines: Vec<Counters>,
    /// The engine of each turn, by (session, turn), as prefixlb's access log names it; empty
    /// for the other routers.
    pub peers: BTreeMap<(usize, usize), String>,
    /// The system prompt of each session.
    pub systems: Vec<usize>,
    /// The prefill rate prefixlb had learned of each engine at the pass's end (its metrics'
    /// lines).
    pub learned: Vec<String>,
}

/// One engine's counters over a pass, as it names them: `prompt_tokens_total` and
/// `prompt_tokens_cached_total` (llama.cpp's under `llamacpp:`, vLLM's under `vllm:`), each
/// counting as its engine does (vLLM's `prompt_tokens_total` counts every prompt token, cached
/// or not). Which engine a router sent how much to, for the routers whose logs do not say.
#[derive(Clone, Copy, Default)]
pub struct Counters {
    pub prompt: f64,
    pub cached: f64,
}

impl Counters {
    /// Both counters from a metrics page, under the engine's `prefix` (`llamacpp:`, `vllm:`).
    pub fn read(page: &str, prefix: &str) -> Self {
        Self {
            prompt: metric(page, &format!("{prefix}prompt_tokens_total")),
            cached: metric(page, &format!("{prefix}prompt_tokens_cached_total")),
        }
    }

    /// What the counters added since `before`.
    fn since(self, before: Self) -> Self {
        Self {
            prompt: self.prompt - before.prompt,
            cached: self.cached - before.cached,
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"prompt_tokens_total": self.prompt, "prompt_tokens_cached_total": self.cached})
    }
}

/// The engines the routers are in front of.
pub enum Engines<'a> {
    /// llama.cpp's, started fresh for every pass (in a fraction of a second).
    Llama(&'a Setup),
    /// vLLM's, started once; their prefix caches are emptied before every pass.
    Vllm(&'a vllm::Engines),
}

impl Engines<'_> {
    pub fn name(&self) -> &'static str {
        match self {
            Engines::Llama(_) => "llama.cpp",
            Engines::Vllm(_) => "vLLM",
        }
    }
}

/// One pass of `router` on `seed`; `tag` ends the name of its kept log (the run, with several).
pub async fn pass(
    engines: &Engines<'_>,
    router: Router,
    seed: u64,
    tag: &str,
) -> Result<Pass, String> {
    let workload = Workload::new(seed);
    let logs = tempfile::tempdir().map_err(|e| e.to_string())?;
    // Nothing cached from the previous router.
    let (llama, addrs, before) = match engines {
        Engines::Llama(setup) => {
            let started = setup.engines(2, logs.path()).await;
            let addrs = started.iter().map(|e| e.addr).collect();
            (started, addrs, vec![Counters::default(); 2])
        }
        Engines::Vllm(v) => {
            v.reset().await?;
            (Vec::new(), v.addrs(), v.counters().await)
        }
    };
    let (entry, running) = router.start(&addrs).await?;
    let url = format!("http://{}/v1/chat/completions", entry[0]);
    let header = router.sends_header();
    let start = Instant::now();
    let sessions: Vec<_> = workload
        .sessions
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let system = workload.prompts[s.system].clone();
            let (session, url) = (s.clone(), url.clone());
            tokio::spawn(async move { play(&url, i, header, system, session).await })
        })
        .collect();
    let mut turns = Vec::new();
    for s in sessions {
        turns.extend(s.await.map_err(|e| e.to_string())?);
    }
    let wall = start.elapsed();
    let peers = peers_of(&running.access_log(turns.len()).await);
    running.keep_log(&format!("{} {} {seed}{tag}", router.name(), engines.name()));
    let learned = running
        .series("prefixlb_peer_prefill_tokens_per_second")
        .await;
    drop(running);
    let after = match engines {
        Engines::Llama(_) => {
            let mut totals = Vec::new();
            for e in &llama {
                totals.push(Counters::read(&e.metrics().await, "llamacpp:"));
            }
            totals
        }
        Engines::Vllm(v) => v.counters().await,
    };
    let engines = after
        .iter()
        .zip(&before)
        .map(|(a, b)| a.since(*b))
        .collect();
    drop(llama);
    Ok(Pass {
        turns,
        wall,
        engines,
        peers,
        systems: workload.sessions.iter().map(|s| s.system).collect(),
        learned,
    })
}

/// The engine of each turn, read from prefixlb's access log, whose `request_id` is the
/// client's `s{session}-t{turn}`; empty for the other routers.
fn peers_of(log: &str) -> BTreeMap<(usize, usize), String> {
    let mut peers = BTreeMap::new();
    for line in log.lines() {
        let field = |name: &str| line.split(' ').find_map(|w| w.strip_prefix(name));
        let (Some(id), Some(peer)) = (field("request_id="), field("peer=")) else {
            continue;
        };
        let turn = id.strip_prefix('s').and_then(|id| id.split_once("-t"));
        if let Some((Ok(s), Ok(t))) = turn.map(|(s, t)| (s.parse::<usize>(), t.parse::<usize>())) {
            peers.insert((s, t), peer.to_owned());
        }
    }
    peers
}

impl Pass {
    /// Later turns that went to another engine than their session's turn before; `None` for a
    /// router that writes no access log (all but prefixlb). Each such turn prefills its
    /// conversation again, all but the system prompt: what routing for load costs the cache.
    pub fn moved(&self) -> Option<usize> {
        let peers = &self.peers;
        let moved = peers.iter().filter(|((s, t), peer)| {
            *t > 0
                && peers
                    .get(&(*s, t - 1))
                    .is_some_and(|before| before != *peer)
        });
        (!peers.is_empty()).then(|| moved.count())
    }
}

/// A session's turns, each resending the whole conversation; a failed turn leaves an empty
/// answer in the history and the session goes on.
async fn play(
    url: &str,
    i: usize,
    header: bool,
    system: String,
    session: Session,
) -> Vec<Option<Turn>> {
    tokio::time::sleep(session.arrival).await;
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut turns = Vec::new();
    for (t, question) in session.turns.into_iter().enumerate() {
        if t > 0 {
            tokio::time::sleep(session.think[t - 1]).await;
        }
        messages.push(json!({"role": "user", "content": question}));
        let body = json!({
            "model": MODEL,
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "stream": true,
            // As OpenAI's clients ask to count tokens: vLLM says what it had cached only
            // then (llama.cpp says it in its timings anyway).
            "stream_options": {"include_usage": true},
        });
        let mut request = reqwest::Client::new()
            .post(url)
            .header("x-request-id", format!("s{i}-t{t}"))
            .json(&body)
            .timeout(Duration::from_secs(120));
        if header {
            request = request.header(SESSION_HEADER, format!("session-{i}"));
        }
        // In a task of its own: the stream reader asserts on what it reads, and a failed turn
        // is counted, not fatal.
        let start = Instant::now();
        let reply = tokio::spawn(async move {
            let response = request.send().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(stream::read(response, start).await)
        })
        .await;
        let turn = match reply {
            Ok(Ok(r)) if r.done && r.error.is_none() => {
                messages.push(json!({"role": "assistant", "content": r.text}));
                Some(Turn {
                    ttft: r.ttft,
                    e2e: start.elapsed(),
                    prompt: r.prompt,
                    cached: r.cached,
                })
            }
            _ => {
                messages.push(json!({"role": "assistant", "content": ""}));
                None
            }
        };
        turns.push(turn);
    }
    turns
}

/// A counter's value on a Prometheus page, summed over its labels (0 when absent).
pub fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
