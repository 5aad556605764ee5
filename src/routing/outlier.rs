//! Passive outlier ejection: a peer whose requests keep failing is left out for a while, and
//! for twice as long each time it fails again as soon as it is back.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// When to eject a peer that keeps failing, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutlierPolicy {
    /// Consecutive failures (connect errors, 5xx) that eject a peer; 0 never ejects.
    pub consecutive_failures: u32,
    /// The first ejection; each one that follows a failed probe lasts twice as long.
    pub base_ejection: Duration,
    pub max_ejection: Duration,
    /// The most peers ejected at once, as a share of the members in percent; one is always
    /// allowed. A burst of engine errors must not empty the cluster.
    pub max_ejected_percent: u32,
}

impl Default for OutlierPolicy {
    fn default() -> Self {
        Self {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(5),
            max_ejection: Duration::from_secs(300),
            max_ejected_percent: 50,
        }
    }
}

impl OutlierPolicy {
    /// Whether one more of `members` peers may be ejected while `ejected` are.
    pub fn may_eject(&self, ejected: usize, members: usize) -> bool {
        ejected == 0 || (ejected + 1) * 100 <= self.max_ejected_percent as usize * members
    }
}

/// One peer's outlier state: consecutive failures, consecutive ejections (the backoff exponent;
/// above 0 the peer is on probation) and when the current ejection ends.
#[derive(Debug, Default)]
pub struct Outlier {
    failures: AtomicU32,
    ejections: AtomicU32,
    ejected: AtomicBool,
    ejected_until_ms: AtomicU64,
}

/// Milliseconds on a clock shared by every peer, so an ejection's end fits in an atomic.
fn now_ms() -> u64 {
    static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
    EPOCH.elapsed().as_millis() as u64
}

impl Outlier {
    /// Ejected for failing, and the ejection has not run out. Once it has, the peer takes
    /// requests again on probation: its next failure ejects it again, for twice as long.
    pub fn ejected(&self) -> bool {
        if !self.ejected.load(Ordering::Relaxed) {
            return false;
        }
        if now_ms() < self.ejected_until_ms.load(Ordering::Relaxed) {
            return true;
        }
        self.ejected.store(false, Ordering::Relaxed);
        false
    }

    /// A request got an answer that is not a server error.
    pub fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if !self.ejected() {
            self.ejections.store(0, Ordering::Relaxed);
        }
    }

    /// A request failed to connect or got a 5xx. Returns the ejection it caused, if any;
    /// with `may_eject` off (too many peers are out already) it counts the failure only.
    pub fn record_failure(&self, policy: &OutlierPolicy, may_eject: bool) -> Option<Duration> {
        if policy.consecutive_failures == 0 || self.ejected() {
            return None;
        }
        let on_probation = self.ejections.load(Ordering::Relaxed) > 0;
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if (!on_probation && failures < policy.consecutive_failures) || !may_eject {
            return None;
        }
        self.failures.store(0, Ordering::Relaxed);
        let exponent = self.ejections.fetch_add(1, Ordering::Relaxed).min(16);
        let backoff = policy
            .base_ejection
            .saturating_mul(1 << exponent)
            .min(policy.max_ejection);
        let until = now_ms() + backoff.as_millis() as u64;
        self.ejected_until_ms.store(until, Ordering::Relaxed);
        self.ejected.store(true, Ordering::Relaxed);
        Some(backoff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ejected_share_is_capped_but_one_is_always_allowed() {
        let half = OutlierPolicy::default();
        assert!(half.may_eject(0, 1), "a lone peer may still be ejected");
        assert!(half.may_eject(0, 4) && half.may_eject(1, 4));
        assert!(!half.may_eject(2, 4), "a third of four would be 75%");
        assert!(!half.may_eject(1, 2));
        let p = Outlier::default();
        let one = OutlierPolicy {
            consecutive_failures: 1,
            ..OutlierPolicy::default()
        };
        assert_eq!(p.record_failure(&one, false), None);
        assert!(!p.ejected(), "a capped failure ejects nothing");
        assert!(p.record_failure(&one, true).is_some());
    }

    #[test]
    fn repeated_failures_eject_with_growing_backoff_and_success_clears() {
        let p = Outlier::default();
        let policy = OutlierPolicy {
            consecutive_failures: 3,
            base_ejection: Duration::from_millis(40),
            max_ejection: Duration::from_millis(100),
            ..OutlierPolicy::default()
        };
        assert_eq!(p.record_failure(&policy, true), None);
        p.record_success();
        assert_eq!(p.record_failure(&policy, true), None);
        assert_eq!(p.record_failure(&policy, true), None);
        assert_eq!(
            p.record_failure(&policy, true),
            Some(Duration::from_millis(40))
        );
        assert!(p.ejected());
        assert_eq!(
            p.record_failure(&policy, true),
            None,
            "an ejected peer gets no requests to fail"
        );
        std::thread::sleep(Duration::from_millis(50));
        assert!(!p.ejected(), "probed again once the ejection ran out");
        // On probation one failure ejects again, for twice as long, capped.
        assert_eq!(
            p.record_failure(&policy, true),
            Some(Duration::from_millis(80))
        );
        std::thread::sleep(Duration::from_millis(90));
        assert_eq!(
            p.record_failure(&policy, true),
            Some(Duration::from_millis(100))
        );
        std::thread::sleep(Duration::from_millis(110));
        p.record_success();
        assert_eq!(
            p.record_failure(&policy, true),
            None,
            "a success ends probation"
        );
    }
}
