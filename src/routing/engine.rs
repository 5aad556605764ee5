//! What a peer's engine shows of itself: the figures its metrics endpoint reports, the running
//! slots inferred from them, the mean time its answers stream, the prefill rate its answers
//! show, and the cached tokens it reported against those the record predicted.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::prefill::PrefillFit;
use super::usage::Usage;

/// What an engine says of itself on its metrics endpoint (vLLM's or SGLang's names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineReport {
    pub running: u32,
    pub waiting: u32,
    /// KV cache in use, 0 to 1, when the engine reports it.
    pub kv_cache_usage: Option<f64>,
    /// The engine's own count of work done since it started (tokens prefilled and generated,
    /// or decode steps), when it reports one: while it grows the engine is working, whether or
    /// not its answers have sent a byte yet (an answer that does not stream sends none until
    /// it is whole).
    pub work: Option<f64>,
}

/// One peer's engine as the balancer knows it.
#[derive(Debug, Default)]
pub struct Engine {
    /// The last report and when it came, and the running slots the reports showed; read by
    /// the admin API and metrics, written by the scraper: off the request path, so a lock is
    /// fine.
    scraped: Mutex<Scraped>,
    /// The running slots as [`SlotPeaks`] reads them (0 until a queue is seen): beyond them a
    /// request waits for a slot. Read on every pricing, so not behind the lock.
    capacity: AtomicU32,
    /// Mean time a request streams its answer, from first byte to end, in microseconds (an
    /// EWMA; 0 until one has ended).
    decode_us: AtomicU32,
    /// The samples of the prefill rate, written when an answer ends.
    fit: Mutex<PrefillFit>,
    /// The rate the fit gives, as `f64` bits (0: none yet): read on every pricing, so not
    /// behind the lock.
    rate: AtomicU64,
    cache: CacheCounts,
}

#[derive(Debug, Default)]
struct Scraped {
    last: Option<(EngineReport, Instant)>,
    slots: SlotPeaks,
}

/// How long a running count seen beside a queue stands for the engine's slots. An engine
/// also queues with slots free: while one long prompt's chunk fills a step's token budget,
/// or its KV memory is short for a moment, arrivals wait beside free slots, and a single
/// report then shows far fewer running than it has slots (on the cluster bench's engine
/// model, 1 to 7 of 8). A window over several such moments keeps the most it has shown it
/// runs; an engine restarted with fewer slots, or lastingly short of memory, is followed
/// within two windows.
const SLOTS_WINDOW: Duration = Duration::from_secs(30);

/// The engine's running slots as its reports show them: the most it ran at once while it
/// had a queue, over the reports that showed one in this window and the one before.
#[derive(Debug, Default)]
struct SlotPeaks {
    current: u32,
    previous: u32,
    since: Option<Instant>,
}

impl SlotPeaks {
    /// Takes one report's figures; returns the slots known since (0 while none is).
    fn observe(&mut self, running: u32, waiting: u32, now: Instant) -> u32 {
        // Only a queue proves the engine full; until one is seen its capacity is unknown,
        // and what it runs says nothing of what it could. Once known, more running than
        // known is more capacity.
        let known = self.slots();
        if waiting > 0 || (known > 0 && running > known) {
            if self
                .since
                .is_none_or(|since| now.duration_since(since) >= SLOTS_WINDOW)
            {
                self.previous = self.current;
                self.current = 0;
                self.since = Some(now);
            }
            self.current = self.current.max(running.max(1));
        }
        self.slots()
    }

    fn slots(&self) -> u32 {
        self.current.max(self.previous)
    }
}

/// Tokens of the answers that reported their usage: the prompts', and the cached ones the
/// record predicted and the engine reported.
#[derive(Debug, Default)]
struct CacheCounts {
    prompt: AtomicU64,
    predicted: AtomicU64,
    reported: AtomicU64,
    /// Answers whose report showed far less cached than the record predicted.
    misses: AtomicU64,
}

/// The engine's cached tokens against the record's prediction, summed over the answers that
/// reported them (in the engine's tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheReport {
    pub prompt_tokens: u64,
    pub predicted_cached: u64,
    pub reported_cached: u64,
    pub misses: u64,
}

impl Engine {
    /// Keeps the last scrape's figures (`None`: it failed) and what they show of the capacity;
    /// true when the engine's count of work grew since the report before.
    pub fn report(&self, figures: Option<EngineReport>) -> bool {
        let now = Instant::now();
        let mut scraped = self.scraped.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = figures {
            let slots = scraped.slots.observe(f.running, f.waiting, now);
            self.capacity.store(slots, Ordering::Relaxed);
        }
        let before = scraped.last.and_then(|(f, _)| f.work);
        scraped.last = figures.map(|f| (f, now));
        matches!((before, figures.and_then(|f| f.work)), (Some(b), Some(a)) if a > b)
    }

    /// The last figures and how old they are, if the last scrape gave any.
    pub fn last(&self) -> Option<(EngineReport, Duration)> {
        let scraped = self.scraped.lock().unwrap_or_else(|p| p.into_inner());
        scraped.last.map(|(f, at)| (f, at.elapsed()))
    }

    /// Running slots the engine has shown it has; 0 while unknown.
    pub fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Relaxed)
    }

    /// How long a request streams its answer here, on average; `None` before one has ended.
    pub fn decode_time(&self) -> Option<Duration> {
        match self.decode_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(u64::from(us))),
        }
    }

    /// Prompt tokens the engine prefills a second, as its answers showed; `None` until enough
    /// of them have.
    pub fn prefill_rate(&self) -> Option<f64> {
        match self.rate.load(Ordering::Relaxed) {
            0 => None,
            bits => Some(f64::from_bits(bits)),
        }
    }

    /// Counts one request that prefilled `tokens` before its first byte, `ttfb` after it was
    /// sent; returns the rate learned so far.
    pub fn record_prefill(&self, tokens: f64, ttfb: Duration) -> Option<f64> {
        let mut fit = self.fit.lock().unwrap_or_else(|p| p.into_inner());
        fit.add(tokens, ttfb.as_secs_f64());
        let rate = fit.rate();
        self.rate
            .store(rate.map_or(0, f64::to_bits), Ordering::Relaxed);
        rate
    }

    /// Counts one answer's usage against the share of its prompt the record predicted cached.
    pub fn record_usage(&self, usage: Usage, predicted_share: f64, missed: bool) {
        let c = &self.cache;
        let prompt = u64::from(usage.prompt_tokens);
        let predicted = (prompt as f64 * predicted_share.clamp(0.0, 1.0)).round() as u64;
        c.prompt.fetch_add(prompt, Ordering::Relaxed);
        c.predicted.fetch_add(predicted, Ordering::Relaxed);
        c.reported
            .fetch_add(u64::from(usage.cached_tokens), Ordering::Relaxed);
        c.misses.fetch_add(u64::from(missed), Ordering::Relaxed);
    }

    pub fn cache_report(&self) -> CacheReport {
        let c = &self.cache;
        CacheReport {
            prompt_tokens: c.prompt.load(Ordering::Relaxed),
            predicted_cached: c.predicted.load(Ordering::Relaxed),
            reported_cached: c.reported.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
        }
    }

    /// Counts one answer that streamed for `held`.
    pub fn record_decode(&self, held: Duration) {
        let sample = held.as_micros().clamp(1, u128::from(u32::MAX)) as u32;
        // An EWMA over about the last eight requests: recent enough to follow a change of
        // workload, smooth enough that one long answer does not swing it.
        let _ = self
            .decode_us
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |mean| {
                Some(if mean == 0 {
                    sample
                } else {
                    ((u64::from(mean) * 7 + u64::from(sample)) / 8) as u32
                })
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(running: u32, waiting: u32) -> Option<EngineReport> {
        Some(EngineReport {
            running,
            waiting,
            kv_cache_usage: None,
            work: None,
        })
    }

    #[test]
    fn only_a_queue_shows_the_capacity() {
        let e = Engine::default();
        e.report(report(5, 0));
        assert_eq!(e.capacity(), 0, "running without a queue says nothing");
        e.report(report(6, 2));
        assert_eq!(e.capacity(), 6);
        e.report(report(8, 0));
        assert_eq!(e.capacity(), 8, "more running than known is more capacity");
        e.report(report(1, 5));
        assert_eq!(e.capacity(), 8, "a queue beside free slots");
        e.report(None);
        assert_eq!((e.capacity(), e.last()), (8, None));
    }

    #[test]
    fn fewer_slots_show_after_two_windows_of_queues() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut peaks = SlotPeaks::default();
        assert_eq!(peaks.observe(8, 3, at(0)), 8);
        assert_eq!(peaks.observe(2, 3, at(10)), 8, "a moment's stall");
        assert_eq!(peaks.observe(4, 0, at(100)), 8, "no queue, no news");
        assert_eq!(peaks.observe(4, 2, at(110)), 8, "the window before");
        assert_eq!(peaks.observe(4, 2, at(140)), 4, "two windows of four");
        assert_eq!(peaks.observe(6, 0, at(150)), 6, "more running than known");
    }

    #[test]
    fn the_decode_time_follows_the_answers() {
        let e = Engine::default();
        assert_eq!(e.decode_time(), None);
        e.record_decode(Duration::from_millis(800));
        assert_eq!(e.decode_time(), Some(Duration::from_millis(800)));
        e.record_decode(Duration::ZERO);
        assert_eq!(e.decode_time(), Some(Duration::from_micros(700_000)));
    }
}
