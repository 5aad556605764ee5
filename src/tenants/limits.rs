//! What a tenant may spend and why a request is refused: the limits of one key, and the token
//! bucket that meters its rates.

use std::time::{Duration, Instant};

/// What one key may spend; `None` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    pub max_concurrent: Option<u32>,
    pub requests_per_second: Option<f64>,
    pub prompt_bytes_per_second: Option<f64>,
}

/// Why a tenant's request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverLimit {
    Concurrency,
    /// The request rate; retry after the duration.
    Requests(Duration),
    /// The prompt-byte rate; retry after the duration.
    PromptBytes(Duration),
}

impl OverLimit {
    pub fn as_str(self) -> &'static str {
        match self {
            OverLimit::Concurrency => "concurrency",
            OverLimit::Requests(_) => "request_rate",
            OverLimit::PromptBytes(_) => "prompt_byte_rate",
        }
    }

    /// When trying again may succeed, in whole seconds (at least 1, as `Retry-After` counts).
    pub fn retry_after_secs(self) -> u32 {
        let wait = match self {
            OverLimit::Concurrency => Duration::from_secs(1),
            OverLimit::Requests(d) | OverLimit::PromptBytes(d) => d,
        };
        (wait.as_secs_f64().ceil() as u32).max(1)
    }
}

/// The longest wait a refusal names: beyond it, a client is better told to come back later
/// than given a date.
pub(crate) const LONGEST_WAIT: Duration = Duration::from_secs(3600);

/// A token bucket that holds a second's allowance and may be overdrawn by one take.
#[derive(Debug)]
pub(crate) struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    pub(crate) fn full(rate: f64, now: Instant) -> Self {
        Self {
            tokens: rate.max(1.0),
            at: now,
        }
    }

    /// Takes `cost` once the bucket holds it, or a full bucket for a cost larger than that
    /// (which overdraws it); otherwise says how long until it does.
    pub(crate) fn take(&mut self, rate: f64, cost: f64, now: Instant) -> Result<(), Duration> {
        let capacity = rate.max(1.0);
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(capacity);
        self.at = now;
        let needed = cost.min(capacity);
        if self.tokens < needed {
            let wait = Duration::try_from_secs_f64((needed - self.tokens) / rate);
            return Err(wait.unwrap_or(Duration::MAX).min(LONGEST_WAIT));
        }
        self.tokens -= cost;
        Ok(())
    }
}
