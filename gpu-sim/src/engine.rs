//! The engine model: a continuous-batching scheduler stepping iterations as vLLM V1 and
//! SGLang do, for a bench whose GPUs must not obey the router's own cost model.
//!
//! - Each step runs one token of every running decode and prefill chunks, under a budget of
//!   `max_batched_tokens` tokens; a step lasts `decode_ms_per_token` plus
//!   `1 / prefill_tokens_per_sec` per prefill token plus `batch_slowdown ×
//!   decode_ms_per_token` per decoding sequence, so a long prompt and the streams beside it
//!   slow each other down.
//! - Running requests hold KV blocks ([`KvPool`]) for their prompt and generated tokens.
//!   When a step needs blocks and none are free, the most recently admitted running request
//!   is preempted: its blocks are given back and it returns to the front of the waiting line,
//!   to prefill its prompt and what it generated again (vLLM's recompute preemption).
//! - The prefix cache is looked up when a request is admitted, so two requests with the same
//!   cold prefix admitted together both prefill it.
//! - Each request first pays `request_overhead_ms` (tokenisation, scheduling).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, Notify};

use crate::kv::KvPool;
use crate::{Prefilled, SimConfig, SimStats};

/// What the scheduler tells a request's caller.
pub enum Event {
    Prefilled(Prefilled),
    Token(usize),
}

struct Request {
    hashes: Vec<u64>,
    prompt_tokens: usize,
    max_tokens: usize,
    /// Tokens to compute before decoding: the prompt, plus what was generated before a
    /// preemption.
    target: usize,
    computed: usize,
    generated: usize,
    /// Named blocks held, then private blocks held.
    named: Vec<u64>,
    private: usize,
    first_prefill: bool,
    admitted: bool,
    /// Prompt tokens found cached at the first admission.
    cached: usize,
    /// Tokens this step computes for it.
    step: usize,
    events: mpsc::UnboundedSender<Event>,
}

impl Request {
    fn held(&self) -> usize {
        self.named.len() + self.private
    }

    fn release(&mut self, kv: &mut KvPool) {
        for h in self.named.drain(..) {
            kv.release(h);
        }
        kv.free_private(self.private);
        self.private = 0;
    }
}

pub struct Engine {
    config: SimConfig,
    stats: Arc<SimStats>,
    state: Mutex<State>,
    work: Notify,
}

struct State {
    waiting: VecDeque<Request>,
    running: Vec<Request>,
    kv: KvPool,
}

impl Engine {
    pub fn new(config: SimConfig, stats: Arc<SimStats>) -> Arc<Self> {
        let blocks = config.cache_tokens / config.block_tokens.max(1);
        let engine = Arc::new(Self {
            state: Mutex::new(State {
                waiting: VecDeque::new(),
                running: Vec::new(),
                kv: KvPool::new(blocks),
            }),
            work: Notify::new(),
            config,
            stats,
        });
        tokio::spawn(Arc::clone(&engine).step_loop());
        engine
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fraction of the KV blocks held by running requests. Idle cached blocks count as free,
    /// as both vLLM's `kv_cache_usage_perc` and SGLang's `token_usage` count them.
    pub fn usage(&self) -> f64 {
        let s = self.state();
        s.kv.busy() as f64 / s.kv.total().max(1) as f64
    }

    /// Blocks held by running requests, and the pool's size, in tokens.
    pub fn tokens_held(&self) -> (usize, usize) {
        let s = self.state();
        let bt = self.config.block_tokens;
        (s.kv.busy() * bt, s.kv.total() * bt)
    }

    /// Queues a request; its events arrive on the returned receiver, which closes when it ends.
    pub async fn submit(
        &self,
        hashes: Vec<u64>,
        prompt_tokens: usize,
        max_tokens: usize,
    ) -> mpsc::UnboundedReceiver<Event> {
        let c = &self.config;
        tokio::time::sleep(c.scaled(c.request_overhead_ms / 1000.0)).await;
        let (tx, rx) = mpsc::unbounded_channel();
        let mut s = self.state();
        s.waiting.push_back(Request {
            hashes,
            prompt_tokens: prompt_tokens.max(1),
            max_tokens,
            target: prompt_tokens.max(1),
            computed: 0,
            generated: 0,
            named: Vec::new(),
            private: 0,
            first_prefill: true,
            admitted: false,
            cached: 0,
            step: 0,
            events: tx,
        });
        self.publish(&s);
        drop(s);
        self.work.notify_one();
        rx
    }

    fn publish(&self, s: &State) {
        let st = &self.stats;
        st.running.store(s.running.len() as i64, Ordering::Relaxed);
        st.waiting.store(s.waiting.len() as i64, Ordering::Relaxed);
        st.evictions.store(s.kv.evictions, Ordering::Relaxed);
    }

    async fn step_loop(self: Arc<Self>) {
        loop {
            let Some(ms) = self.schedule() else {
                self.work.notified().await;
                continue;
            };
            tokio::time::sleep(self.config.scaled(ms / 1000.0)).await;
            self.finish_step();
        }
    }

    /// Picks this step's work (each running request's `step` tokens) and returns how long
    /// the step takes, or None when there is nothing to run.
    fn schedule(&self) -> Option<f64> {
        let c = &self.config;
        let bt = c.block_tokens;
        let mut guard = self.state();
        let s = &mut *guard;
        s.running.retain_mut(|r| {
            let gone = r.events.is_closed();
            if gone {
                r.release(&mut s.kv);
            }
            !gone
        });
        for r in &mut s.running {
            r.step = 0;
        }
        let mut budget = c.max_batched_tokens.max(1);
        let (mut prefill, mut decodes) = (0, 0);
        let mut room = true;
        let mut i = 0;
        while i < s.running.len() && budget > 0 {
            let r = &s.running[i];
            let want = r.target.saturating_sub(r.computed).clamp(1, budget);
            if !self.grow(s, i, want) {
                room = false;
                break;
            }
            let r = &mut s.running[i];
            if r.computed < r.target {
                prefill += want;
            } else {
                decodes += 1;
            }
            r.step = want;
            budget -= want;
            i += 1;
        }
        // No admission in a step that had to preempt: the preempted go first, later.
        while room && s.running.len() < c.max_running.max(1) && budget > 0 {
            let Some(mut r) = s.waiting.pop_front() else {
                break;
            };
            // At least the prompt's last token is computed, to yield the first output.
            let hit = s.kv.hits(&r.hashes).min((r.target - 1) / bt);
            let want = (r.target - hit * bt).min(budget);
            let need = (hit * bt + want).div_ceil(bt) - hit;
            if !s.kv.allocate(need) {
                // With nothing running the pool is as empty as it gets: a request that does
                // not fit then never will, and is ended (its caller sees the stream stop).
                if !s.running.is_empty() {
                    s.waiting.push_front(r);
                }
                break;
            }
            for &h in &r.hashes[..hit] {
                s.kv.hold(h);
            }
            // Hits count at the first admission only: a preempted request finding its own
            // blocks again says nothing of where it was routed.
            if !r.admitted {
                r.admitted = true;
                r.cached = (hit * bt).min(r.prompt_tokens);
                self.stats
                    .prefix_queries
                    .fetch_add(r.prompt_tokens as u64, Ordering::Relaxed);
                self.stats
                    .prefix_hits
                    .fetch_add(r.cached as u64, Ordering::Relaxed);
            }
            r.named = r.hashes[..hit].to_vec();
            r.private = need;
            r.computed = hit * bt;
            r.step = want;
            prefill += want;
            budget -= want;
            s.running.push(r);
        }
        self.publish(s);
        if prefill + decodes == 0 {
            return None;
        }
        let per_prefill = 1000.0 / c.prefill_tokens_per_sec.max(1e-9);
        Some(
            c.decode_ms_per_token
                + prefill as f64 * per_prefill
                + decodes as f64 * c.decode_ms_per_token * c.batch_slowdown,
        )
    }

    /// Ends a step: prefills advance (their full prompt blocks become cached), a prefill
    /// that completes yields a token, every decode yields one.
    fn finish_step(&self) {
        let bt = self.config.block_tokens;
        let mut guard = self.state();
        let s = &mut *guard;
        let mut i = 0;
        while i < s.running.len() {
            let r = &mut s.running[i];
            let decoding = r.computed >= r.target;
            r.computed += r.step;
            while r.named.len() < r.hashes.len() && (r.named.len() + 1) * bt <= r.computed {
                let h = r.hashes[r.named.len()];
                s.kv.name(h);
                r.named.push(h);
                r.private -= 1;
            }
            let token = r.step > 0 && (decoding || r.computed >= r.target);
            let mut gone = false;
            if token {
                if r.first_prefill {
                    r.first_prefill = false;
                    gone |= r
                        .events
                        .send(Event::Prefilled(Prefilled {
                            prompt_tokens: r.prompt_tokens,
                            cached_tokens: r.cached,
                        }))
                        .is_err();
                }
                gone |= r.events.send(Event::Token(r.generated)).is_err();
                r.generated += 1;
            }
            if gone || r.generated >= r.max_tokens {
                let mut r = s.running.remove(i);
                r.release(&mut s.kv);
                if !gone {
                    self.stats.requests.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            }
            i += 1;
        }
        self.publish(s);
    }

    /// Gives running request `i` blocks for `want` more tokens, preempting the most recently
    /// admitted requests until there is room; false if `i` itself was preempted.
    fn grow(&self, s: &mut State, i: usize, want: usize) -> bool {
        let bt = self.config.block_tokens;
        loop {
            let r = &s.running[i];
            let need = (r.computed + want).div_ceil(bt).saturating_sub(r.held());
            if s.kv.allocate(need) {
                s.running[i].private += need;
                return true;
            }
            let Some(mut victim) = s.running.pop() else {
                return false;
            };
            victim.release(&mut s.kv);
            if s.running.is_empty() {
                // Alone and still short of room: it can never finish.
                return false;
            }
            victim.target = victim.prompt_tokens + victim.generated.saturating_sub(1);
            victim.computed = 0;
            s.waiting.push_front(victim);
            self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
            if s.running.len() == i {
                return false;
            }
        }
    }
}
