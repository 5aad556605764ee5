//! The steady load: clients each holding multi-turn conversations under one shared system
//! prompt, every turn a streamed chat completion, each stream read to its end and checked
//! whole (every token the engine was asked for, the usage event, `[DONE]`). A turn that fails
//! ends its conversation and the next one starts at once, on the same keep-alive connection,
//! as a client that retries does.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};

use crate::engines::MODEL;

/// Longer than any stream takes here (a few seconds): a request past it hangs.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Default)]
pub struct Counters {
    pub sent: AtomicU64,
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    /// Times to first token of the turns that succeeded since the sampler last took them.
    pub ttft_ms: Mutex<Vec<f64>>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Cause {
    /// A response other than 200, with its body.
    Status { code: u16, body: String },
    /// The connection failed: before the response head (`phase` "send") or in the body.
    Transport { phase: &'static str, error: String },
    /// An SSE event carrying an error, as prefixlb ends a stream whose engine failed.
    ErrorEvent { data: String },
    /// The stream ended cleanly but short of what a whole answer holds.
    Incomplete { what: String },
    /// An event that is not JSON.
    Malformed { data: String },
}

impl Cause {
    /// Whether the response head had come (a 200) before it failed: a stream cut mid-way,
    /// rather than a request refused.
    pub fn mid_stream(&self) -> bool {
        match self {
            Cause::Status { .. } => false,
            Cause::Transport { phase, .. } => *phase != "send",
            _ => true,
        }
    }
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cause::Status { code, body } => write!(f, "status {code}: {body}"),
            Cause::Transport { phase, error } => write!(f, "transport error ({phase}): {error}"),
            Cause::ErrorEvent { data } => write!(f, "error event: {data}"),
            Cause::Incomplete { what } => write!(f, "incomplete stream: {what}"),
            Cause::Malformed { data } => write!(f, "malformed event: {data}"),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub request_id: String,
    /// Seconds from the start of the load.
    pub sent_s: f64,
    pub failed_s: f64,
    /// The engine that answered, from the `x-upstream` header gpu-sim sends and prefixlb
    /// passes on; filled from prefixlb's access log when no head came back.
    pub engine: Option<String>,
    /// Tokens received before the failure.
    pub tokens: usize,
    pub cause: Cause,
}

pub struct Load {
    stop: Arc<AtomicBool>,
    pub counters: Arc<Counters>,
    pub failures: Arc<Mutex<Vec<Failure>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    pub fn start(clients: usize, url: String, epoch: Instant) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let failures = Arc::new(Mutex::new(Vec::new()));
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(clients)
            .build()
            .expect("an HTTP client");
        let system: Arc<str> = system_prompt().into();
        let tasks = (0..clients)
            .map(|i| {
                let c = Client {
                    index: i,
                    http: http.clone(),
                    url: url.clone(),
                    epoch,
                    system: Arc::clone(&system),
                    counters: Arc::clone(&counters),
                    failures: Arc::clone(&failures),
                };
                tokio::spawn(c.run(Arc::clone(&stop)))
            })
            .collect();
        Self {
            stop,
            counters,
            failures,
            tasks,
        }
    }

    /// Lets every client finish the turn it is on, and waits for them.
    pub async fn stop(self) -> Vec<Failure> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            let _ = t.await;
        }
        let failures = self.failures.lock().unwrap().clone();
        failures
    }
}

/// What every conversation starts with: long enough that prefixlb routes on a shared prefix.
fn system_prompt() -> String {
    let rules: Vec<String> = (0..40)
        .map(|i| format!("Rule {i}: answer the clinic's questions briefly and cite the protocol."))
        .collect();
    format!(
        "You are the assistant of a soak test.\n{}",
        rules.join("\n")
    )
}

struct Client {
    index: usize,
    http: reqwest::Client,
    url: String,
    epoch: Instant,
    system: Arc<str>,
    counters: Arc<Counters>,
    failures: Arc<Mutex<Vec<Failure>>>,
}

/// A turn that succeeded: the answer's text, and its time to first token.
struct Answer {
    text: String,
    ttft: Duration,
}

impl Client {
    async fn run(self, stop: Arc<AtomicBool>) {
        let mut rng = StdRng::seed_from_u64(0x50a4 + self.index as u64);
        let mut n = 0u64;
        let mut conversation = 0u64;
        while !stop.load(Ordering::SeqCst) {
            conversation += 1;
            let mut messages = vec![
                json!({"role": "system", "content": &*self.system}),
                json!({"role": "user", "content": format!("Client {} conversation {conversation}: patient {} asks about dose {}.", self.index, rng.random_range(0..100_000), rng.random_range(0..1000))}),
            ];
            for turn in 0..rng.random_range(2..=6) {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let max_tokens = rng.random_range(16..=96);
                let body = json!({"model": MODEL, "stream": true, "stream_options": {"include_usage": true}, "max_tokens": max_tokens, "messages": messages});
                let id = format!("soak-c{}-{n}", self.index);
                n += 1;
                let sent = self.epoch.elapsed().as_secs_f64();
                self.counters.sent.fetch_add(1, Ordering::Relaxed);
                match self.turn(&id, &body, max_tokens).await {
                    Ok(answer) => {
                        self.counters.ok.fetch_add(1, Ordering::Relaxed);
                        let ttft = answer.ttft.as_secs_f64() * 1e3;
                        self.counters.ttft_ms.lock().unwrap().push(ttft);
                        messages.push(json!({"role": "assistant", "content": answer.text}));
                        messages.push(
                            json!({"role": "user", "content": format!("And question {turn}?")}),
                        );
                    }
                    Err((engine, tokens, cause)) => {
                        self.counters.failed.fetch_add(1, Ordering::Relaxed);
                        self.failures.lock().unwrap().push(Failure {
                            request_id: id,
                            sent_s: sent,
                            failed_s: self.epoch.elapsed().as_secs_f64(),
                            engine,
                            tokens,
                            cause,
                        });
                        break;
                    }
                }
                let think = Duration::from_millis(rng.random_range(50..400));
                tokio::time::sleep(think).await;
            }
        }
    }

    /// One streamed turn; on failure, the engine if known, the tokens received, and why.
    async fn turn(
        &self,
        id: &str,
        body: &Value,
        max_tokens: usize,
    ) -> Result<Answer, (Option<String>, usize, Cause)> {
        let start = Instant::now();
        let response = self
            .http
            .post(&self.url)
            .header("x-request-id", id)
            .timeout(REQUEST_TIMEOUT)
            .json(body)
            .send()
            .await
            .map_err(|e| (None, 0, transport("send", &e)))?;
        let engine = response
            .headers()
            .get("x-upstream")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let fail = |tokens, cause| (engine.clone(), tokens, cause);
        let status = response.status().as_u16();
        if status != 200 {
            let body = response.text().await.unwrap_or_default();
            return Err(fail(0, Cause::Status { code: status, body }));
        }
        let mut reader = Sse::default();
        let mut body = response.bytes_stream();
        let mut ttft = None;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| fail(reader.tokens, transport("body", &e)))?;
            reader
                .feed(&chunk)
                .map_err(|cause| fail(reader.tokens, cause))?;
            if ttft.is_none() && reader.tokens > 0 {
                ttft = Some(start.elapsed());
            }
        }
        let missing = if !reader.done {
            Some("no [DONE]".to_owned())
        } else if !reader.usage {
            Some("no usage event".to_owned())
        } else if reader.tokens != max_tokens {
            Some(format!("{} tokens of {max_tokens}", reader.tokens))
        } else {
            None
        };
        if let Some(what) = missing {
            return Err(fail(reader.tokens, Cause::Incomplete { what }));
        }
        Ok(Answer {
            text: reader.text,
            ttft: ttft.unwrap_or_else(|| start.elapsed()),
        })
    }
}

fn transport(phase: &'static str, e: &reqwest::Error) -> Cause {
    // reqwest's own message is terse ("error decoding response body"): the causes say what
    // happened underneath.
    let mut error = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        error.push_str(": ");
        error.push_str(&s.to_string());
        source = s.source();
    }
    if e.is_timeout() {
        error.push_str(" (timeout)");
    }
    Cause::Transport { phase, error }
}

/// An SSE stream read as it arrives: events are split on blank lines, whatever the chunks.
#[derive(Default)]
struct Sse {
    pending: Vec<u8>,
    text: String,
    tokens: usize,
    usage: bool,
    done: bool,
}

impl Sse {
    fn feed(&mut self, chunk: &[u8]) -> Result<(), Cause> {
        self.pending.extend_from_slice(chunk);
        while let Some(end) = memchr::memmem::find(&self.pending, b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            for data in event.lines().filter_map(|l| l.strip_prefix("data:")) {
                self.event(data.trim())?;
            }
        }
        Ok(())
    }

    fn event(&mut self, data: &str) -> Result<(), Cause> {
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value = serde_json::from_str(data).map_err(|_| Cause::Malformed {
            data: data.chars().take(300).collect(),
        })?;
        if v.get("error").is_some() {
            return Err(Cause::ErrorEvent {
                data: data.chars().take(500).collect(),
            });
        }
        if v.get("usage").is_some_and(|u| !u.is_null()) {
            self.usage = true;
        }
        if let Some(piece) = v
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
        {
            if !piece.is_empty() {
                self.tokens += 1;
                self.text.push_str(piece);
            }
        }
        Ok(())
    }
}
