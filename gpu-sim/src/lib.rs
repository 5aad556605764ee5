//! A stand-in for an LLM inference server (vLLM-like) whose timing makes routing quality
//! visible the way a real GPU does: a prefix KV cache, prefill of the uncached tokens on one
//! compute lane (so prefills queue), decode slowed by batch size, and a cap on running
//! requests with a waiting line behind it.
//!
//! Defaults are those of a 7–8B model (Llama-3-8B class) in bf16 on one 80 GB GPU, rounded:
//! - prefill ≈ 10 000 tokens/s: prefill is compute-bound, ~2 FLOPs per parameter per token,
//!   16 TFLOP per 1000 tokens against ~300 TFLOP/s of dense bf16 at ~50% utilisation;
//! - decode 12 ms per token alone (memory-bound: 16 GB of weights read per step at ~2 TB/s
//!   is 8 ms, plus overhead), each further running request adding 2% (at 64 running,
//!   ~27 ms per token: the batch shares each weight read, the KV reads grow);
//! - 128 KiB of KV per token (32 layers × 8 KV heads × 128 × 2 × 2 bytes), so ~40 GB of
//!   cache holds ~300 000 tokens; the default keeps 65 536 (a smaller, shared GPU, so
//!   that eviction shows in minutes of simulated traffic);
//! - a prefill shares the GPU's steps with the running decodes, as chunked prefill does: while
//!   one runs, every decode step also computes a chunk of 512 prompt tokens (vLLM's
//!   `max_num_batched_tokens` with chunked prefill), ~51 ms at that rate, so a GPU taking a
//!   burst of cold prompts streams slowly to everyone on it;
//! - a token is 4 characters of text (OpenAI's rule of thumb for English), blocks are 16
//!   tokens (vLLM's default), at most 64 requests run at once (`max_num_seqs` of a busy
//!   server).
//!
//! `speed` divides every duration, so a benchmark can run a minute of GPU time in seconds
//! with the same ratios; `pace` does the same for one GPU, so a cluster can mix speeds.
//!
//! That is the `Lane` model (the default). [`Model::Engine`] is a continuous-batching
//! scheduler with KV memory and preemption instead: see [`engine`] and [`SimConfig::engine`].

pub mod cache;
pub mod cli;
pub mod engine;
pub mod kv;
pub mod server;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Semaphore;

use cache::{block_hashes, PrefixCache};
use engine::{Engine, Event};

/// How a simulated GPU schedules its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Model {
    /// One FIFO prefill lane beside decodes slowed by batch size; prefixes cached apart from
    /// running requests.
    #[default]
    Lane,
    /// Steps of chunked prefill and decode under a token budget, KV memory held by running
    /// requests, preemption, per-request overhead.
    Engine,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    pub model: Model,
    pub chars_per_token: f64,
    pub block_tokens: usize,
    pub cache_tokens: usize,
    pub prefill_tokens_per_sec: f64,
    pub decode_ms_per_token: f64,
    /// Extra decode time per token for each other running request, as a fraction.
    pub batch_slowdown: f64,
    /// Prompt tokens a decode step also prefills while a prefill runs (0: prefill and decode
    /// do not share steps).
    pub prefill_chunk_tokens: usize,
    pub max_running: usize,
    pub default_max_tokens: usize,
    pub speed: f64,
    /// This GPU's speed relative to the others: 0.5 doubles every duration.
    pub pace: f64,
    /// Engine model: tokens one step computes at most (vLLM's `max_num_batched_tokens`).
    pub max_batched_tokens: usize,
    /// Engine model: tokenisation and scheduling before a request reaches the waiting line.
    pub request_overhead_ms: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: Model::Lane,
            chars_per_token: 4.0,
            block_tokens: 16,
            cache_tokens: 65_536,
            prefill_tokens_per_sec: 10_000.0,
            decode_ms_per_token: 12.0,
            batch_slowdown: 0.02,
            prefill_chunk_tokens: 512,
            max_running: 64,
            default_max_tokens: 64,
            speed: 1.0,
            pace: 1.0,
            max_batched_tokens: 2048,
            request_overhead_ms: 3.0,
        }
    }
}

impl SimConfig {
    /// The engine model's defaults: the lane's GPU figures (a step of one decode takes
    /// `decode_ms_per_token`, each further sequence adds `batch_slowdown` of it, prefill runs
    /// at `prefill_tokens_per_sec`), vLLM's 2048-token step budget, 3 ms of overhead a
    /// request, and 3.3 characters a token (code and non-English text tokenise denser than
    /// OpenAI's 4).
    pub fn engine() -> Self {
        Self {
            model: Model::Engine,
            chars_per_token: 3.3,
            ..Self::default()
        }
    }

    fn scaled(&self, secs: f64) -> Duration {
        let speed = (self.speed * self.pace).max(1e-9);
        Duration::from_secs_f64((secs / speed).max(0.0))
    }

    fn block_bytes(&self) -> usize {
        (self.block_tokens as f64 * self.chars_per_token).round() as usize
    }

    pub fn tokens(&self, text_len: usize) -> usize {
        (text_len as f64 / self.chars_per_token.max(1e-9)).ceil() as usize
    }
}

/// Counters a vLLM server exports, for one simulated GPU.
#[derive(Debug, Default)]
pub struct SimStats {
    pub running: AtomicI64,
    pub waiting: AtomicI64,
    /// Prompt tokens looked up in the prefix cache, and those found.
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    /// Requests served to their last token.
    pub requests: AtomicU64,
    /// Running requests preempted for KV memory (engine model).
    pub preemptions: AtomicU64,
    /// Cached prefix blocks evicted to make room.
    pub evictions: AtomicU64,
}

pub struct Gpu {
    pub config: SimConfig,
    cache: Mutex<PrefixCache>,
    /// One prefill at a time: prefill is compute-bound and takes the whole GPU.
    prefill_lane: tokio::sync::Mutex<()>,
    /// Whether a prefill is running: decode steps are longer then.
    prefilling: AtomicBool,
    slots: Semaphore,
    pub stats: Arc<SimStats>,
    /// The engine model's scheduler, started by the first request (it needs a runtime).
    engine: OnceLock<Arc<Engine>>,
}

/// How a request went, for tests and for the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefilled {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
}

impl Gpu {
    pub fn new(config: SimConfig) -> Self {
        let blocks = config.cache_tokens / config.block_tokens.max(1);
        Self {
            cache: Mutex::new(PrefixCache::new(blocks)),
            prefill_lane: tokio::sync::Mutex::new(()),
            prefilling: AtomicBool::new(false),
            slots: Semaphore::new(config.max_running.max(1)),
            stats: Arc::default(),
            engine: OnceLock::new(),
            config,
        }
    }

    /// Fraction of the cache in use, as vLLM's `kv_cache_usage_perc` reports it (0 to 1): in
    /// the lane model the prefix cache's fill, in the engine model the KV held by running
    /// requests.
    pub fn cache_usage(&self) -> f64 {
        if self.config.model == Model::Engine {
            return self.engine.get().map_or(0.0, |e| e.usage());
        }
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.capacity() == 0 {
            return 0.0;
        }
        cache.len() as f64 / cache.capacity() as f64
    }

    /// Tokens of KV held by running requests, and the GPU's KV capacity in tokens (SGLang's
    /// `num_used_tokens` and `max_total_num_tokens`). The lane model's running requests hold
    /// none: its capacity is the prefix cache's.
    pub fn kv_tokens(&self) -> (usize, usize) {
        match (self.config.model, self.engine.get()) {
            (Model::Engine, Some(e)) => e.tokens_held(),
            _ => (0, self.config.cache_tokens),
        }
    }

    /// Runs one request on this GPU's model. `on_prefilled` is called once its prompt is
    /// prefilled, `token` for each output token; `token` returns false when the client is
    /// gone, which ends the request early.
    pub async fn run(
        &self,
        prompt: &str,
        max_tokens: usize,
        on_prefilled: impl FnMut(Prefilled),
        token: impl FnMut(usize) -> bool,
    ) {
        match self.config.model {
            Model::Lane => self.run_lane(prompt, max_tokens, on_prefilled, token).await,
            Model::Engine => {
                self.run_engine(prompt, max_tokens, on_prefilled, token)
                    .await
            }
        }
    }

    async fn run_engine(
        &self,
        prompt: &str,
        max_tokens: usize,
        mut on_prefilled: impl FnMut(Prefilled),
        mut token: impl FnMut(usize) -> bool,
    ) {
        let c = &self.config;
        let engine = self
            .engine
            .get_or_init(|| Engine::new(c.clone(), Arc::clone(&self.stats)));
        let hashes = block_hashes(prompt.as_bytes(), c.block_bytes());
        let mut events = engine
            .submit(hashes, c.tokens(prompt.len()), max_tokens.max(1))
            .await;
        while let Some(e) = events.recv().await {
            match e {
                Event::Prefilled(p) => on_prefilled(p),
                Event::Token(i) if i < max_tokens => {
                    if !token(i) {
                        return;
                    }
                }
                Event::Token(_) => {}
            }
        }
    }

    /// Runs one request: waits for a running slot, prefills what the cache lacks on the
    /// shared lane, then calls `token` for each of `max_tokens` output tokens at the decode
    /// pace.
    async fn run_lane(
        &self,
        prompt: &str,
        max_tokens: usize,
        mut on_prefilled: impl FnMut(Prefilled),
        mut token: impl FnMut(usize) -> bool,
    ) {
        self.stats.waiting.fetch_add(1, Ordering::Relaxed);
        let permit = self.slots.acquire().await;
        self.stats.waiting.fetch_sub(1, Ordering::Relaxed);
        let Ok(_permit) = permit else { return };
        self.stats.running.fetch_add(1, Ordering::Relaxed);
        let _running = Running(&self.stats.running);

        let c = &self.config;
        let prompt_tokens = c.tokens(prompt.len());
        let hashes = block_hashes(prompt.as_bytes(), c.block_bytes());
        {
            let _lane = self.prefill_lane.lock().await;
            // Looked up on the lane, so that a prefill queued behind the same prefix finds it.
            let found = self
                .cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .lookup(&hashes);
            let cached_tokens = (found.hit_blocks * c.block_tokens).min(prompt_tokens);
            self.stats
                .prefix_queries
                .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
            self.stats
                .prefix_hits
                .fetch_add(cached_tokens as u64, Ordering::Relaxed);
            let uncached = prompt_tokens - cached_tokens;
            if uncached > 0 {
                self.prefilling.store(true, Ordering::Relaxed);
                let _done = Flag(&self.prefilling);
                tokio::time::sleep(c.scaled(uncached as f64 / c.prefill_tokens_per_sec)).await;
            }
            let evicted = self
                .cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(&hashes);
            self.stats
                .evictions
                .fetch_add(evicted as u64, Ordering::Relaxed);
            on_prefilled(Prefilled {
                prompt_tokens,
                cached_tokens,
            });
        }
        for i in 0..max_tokens {
            if !token(i) {
                return;
            }
            if i + 1 < max_tokens {
                let others = (self.stats.running.load(Ordering::Relaxed) - 1).max(0) as f64;
                let mut ms = c.decode_ms_per_token * (1.0 + c.batch_slowdown * others);
                if self.prefilling.load(Ordering::Relaxed) {
                    ms += c.prefill_chunk_tokens as f64 / c.prefill_tokens_per_sec * 1000.0;
                }
                tokio::time::sleep(c.scaled(ms / 1000.0)).await;
            }
        }
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
    }
}

/// Clears a flag when dropped, however the future holding it ends.
struct Flag<'a>(&'a AtomicBool);

impl Drop for Flag<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

struct Running<'a>(&'a AtomicI64);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
