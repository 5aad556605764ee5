//! A peer's prefill rate, learned from its own answers instead of assumed. Each priced request
//! gives one sample when its answer ends: the tokens the peer had to prefill before its first
//! byte (the prefill this process had queued there ahead of it, and its own uncached part,
//! as the engine reported it when it did) against the time to that byte. A line through the
//! samples, `time = overhead + tokens / rate`, keeps a fixed per-request cost (scheduling,
//! the first decode step, the network) out of the rate; older samples fade, so the rate
//! follows an engine whose speed changes (a batch that grows, a slower GPU swapped in).
//!
//! Requests that waited for one of the engine's running slots are not samples: their wait is
//! a queue's, not the prefill's; nor are first bytes quicker than [`MIN_SAMPLE`], nor prompts
//! shorter than [`MIN_SAMPLE_TOKENS`].

use std::time::Duration;

/// How far apart a peer's rate and the peers' must be before it is priced at its own: closer
/// than this, the difference is mostly the samples' noise, and alike GPUs priced apart would
/// move conversations on noise alone. A GPU at half pace stands apart.
pub const RATES_APART: f64 = 1.5;

/// The shortest first byte taken as a sample: below it, the proxy's and the network's own
/// jitter (a millisecond or two under load) is a large part of the time, not the prefill.
pub const MIN_SAMPLE: Duration = Duration::from_millis(10);

/// The fewest tokens to prefill that make a sample: a prompt shorter than this is prefilled in
/// about the time of the engine's fixed cost a request (scheduling, the first decode step), so
/// its first byte measures that cost, and a few such samples would price the peer as a slow
/// prefill on the noise of its scheduling.
pub const MIN_SAMPLE_TOKENS: f64 = 64.0;

/// How much of its weight a sample keeps at each later one: about the last 32 count.
const FADE: f64 = 1.0 - 1.0 / 32.0;
/// Samples before the fit is trusted over the configured rate.
const MIN_SAMPLES: f64 = 4.0;
/// A fit whose token counts barely vary cannot tell overhead from rate: below this spread
/// (as a share of their mean) the rate is the samples' ratio instead, overhead included.
const MIN_SPREAD: f64 = 0.2;

/// Running sums of the faded samples: tokens `x` and seconds `y`.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct PrefillFit {
    n: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl PrefillFit {
    /// Adds one request's prefill: `tokens` prefilled in `secs`.
    pub fn add(&mut self, tokens: f64, secs: f64) {
        if !(tokens >= 1.0 && secs > 0.0 && tokens.is_finite() && secs.is_finite()) {
            return;
        }
        self.n = self.n * FADE + 1.0;
        self.x = self.x * FADE + tokens;
        self.y = self.y * FADE + secs;
        self.xx = self.xx * FADE + tokens * tokens;
        self.xy = self.xy * FADE + tokens * secs;
    }

    /// Tokens prefilled a second, once the samples say.
    pub fn rate(&self) -> Option<f64> {
        if self.n < MIN_SAMPLES {
            return None;
        }
        let mean_x = self.x / self.n;
        let variance = (self.xx / self.n - mean_x * mean_x).max(0.0);
        let ratio = self.x / self.y;
        if variance.sqrt() < MIN_SPREAD * mean_x {
            return Some(ratio);
        }
        let slope = (self.xy / self.n - mean_x * self.y / self.n) / variance;
        // A slope at or below zero, or a line with a negative overhead, is noise (queueing the
        // samples could not see): the ratio, overhead included, is the least the rate can be.
        if slope <= 0.0 || !slope.is_finite() {
            return Some(ratio);
        }
        Some((1.0 / slope).max(ratio))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steady_engine_gives_its_rate_and_leaves_the_overhead_out() {
        let mut fit = PrefillFit::default();
        for i in 0..40 {
            let tokens = 500.0 + f64::from(i % 7) * 700.0;
            fit.add(tokens, 0.03 + tokens / 4_000.0);
            if i < 3 {
                assert_eq!(fit.rate(), None, "three samples are not enough");
            }
        }
        let rate = fit.rate().unwrap();
        assert!((rate - 4_000.0).abs() < 1.0, "{rate}");
    }

    #[test]
    fn alike_samples_give_their_ratio() {
        let mut fit = PrefillFit::default();
        for _ in 0..10 {
            fit.add(2_000.0, 0.5);
        }
        assert!((fit.rate().unwrap() - 4_000.0).abs() < 1e-6);
        fit.add(0.0, 1.0);
        fit.add(10.0, f64::NAN);
        assert!(
            (fit.rate().unwrap() - 4_000.0).abs() < 1e-6,
            "bad samples count"
        );
    }

    #[test]
    fn the_rate_follows_an_engine_that_slows() {
        let mut fit = PrefillFit::default();
        for i in 0..64 {
            let tokens = 1_000.0 + f64::from(i % 5) * 1_000.0;
            fit.add(tokens, tokens / 8_000.0);
        }
        for i in 0..96 {
            let tokens = 1_000.0 + f64::from(i % 5) * 1_000.0;
            fit.add(tokens, tokens / 2_000.0);
        }
        let rate = fit.rate().unwrap();
        assert!((rate / 2_000.0 - 1.0).abs() < 0.1, "{rate}");
    }
}
