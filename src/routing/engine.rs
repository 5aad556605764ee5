//! What a peer's engine shows of itself: the figures its metrics endpoint reports, the running
//! slots inferred from them, and the mean time its answers stream.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What an engine says of itself on its metrics endpoint (vLLM's or SGLang's names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineReport {
    pub running: u32,
    pub waiting: u32,
    /// KV cache in use, 0 to 1, when the engine reports it.
    pub kv_cache_usage: Option<f64>,
}

/// One peer's engine as the balancer knows it.
#[derive(Debug, Default)]
pub struct Engine {
    /// The last report and when it came; read by the admin API and metrics, written by the
    /// scraper: off the request path, so a lock is fine.
    last: Mutex<Option<(EngineReport, Instant)>>,
    /// The most requests the engine has run at once, once it has been seen to queue (0 until
    /// then): beyond it a request waits for a running slot.
    capacity: AtomicU32,
    /// Mean time a request streams its answer, from first byte to end, in microseconds (an
    /// EWMA; 0 until one has ended).
    decode_us: AtomicU32,
}

impl Engine {
    /// Keeps the last scrape's figures (`None`: it failed) and what they show of the capacity.
    pub fn report(&self, figures: Option<EngineReport>) {
        if let Some(f) = figures {
            // Only a queue proves the engine full; until one is seen its capacity is unknown,
            // and what it runs says nothing of what it could.
            let known = self.capacity();
            let capacity = if f.waiting > 0 {
                f.running.max(1)
            } else if known > 0 {
                known.max(f.running)
            } else {
                0
            };
            self.capacity.store(capacity, Ordering::Relaxed);
        }
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        *last = figures.map(|f| (f, Instant::now()));
    }

    /// The last figures and how old they are, if the last scrape gave any.
    pub fn last(&self) -> Option<(EngineReport, Duration)> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.map(|(f, at)| (f, at.elapsed()))
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
        e.report(None);
        assert_eq!((e.capacity(), e.last()), (8, None));
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
