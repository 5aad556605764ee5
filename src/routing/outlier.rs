//! Passive outlier ejection: a peer whose requests keep failing is left out for a while, and
//! for twice as long each time it fails again as soon as it is back.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::clock::now_ms;

/// When to eject a peer that keeps failing, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutlierPolicy {
    /// Consecutive failures (connect errors, [`is_peer_fault`] answers) that eject a peer; 0
    /// never ejects.
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

/// Whether an engine's answer says the engine is unwell (down, overloaded, stuck) rather than
/// that one request went wrong. Only these count towards an ejection: a client can make an
/// engine answer 500 (or 4xx) at will, and must not get the peer its key lands on ejected.
pub fn is_peer_fault(status: u16) -> bool {
    matches!(status, 502..=504)
}

/// One peer's outlier state: consecutive failures, consecutive ejections (the backoff exponent;
/// above 0 the peer is on probation) and when the current ejection ends.
#[derive(Debug, Default)]
pub struct Outlier {
    failures: AtomicU32,
    ejections: AtomicU32,
    /// 0 when not ejected. The end alone says whether the peer is out: a flag beside it could be
    /// cleared by a reader of an ejection that ran out just as another thread began a new one,
    /// where resetting the end itself to 0 succeeds only while it is still the old end.
    ejected_until_ms: AtomicU64,
}

impl Outlier {
    /// Ejected for failing, and the ejection has not run out. Once it has, the peer takes
    /// requests again on probation: its next failure ejects it again, for twice as long.
    pub fn ejected(&self) -> bool {
        let until = self.ejected_until_ms.load(Ordering::Relaxed);
        // Most peers are never ejected: no clock read for them, on every routing decision.
        if until == 0 {
            return false;
        }
        if now_ms() < until {
            return true;
        }
        // Run out: back to "never", unless a new ejection (a later end) has replaced this one.
        let _ =
            self.ejected_until_ms
                .compare_exchange(until, 0, Ordering::Relaxed, Ordering::Relaxed);
        false
    }

    /// A request got an answer that is not a server error.
    pub fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if !self.ejected() {
            self.ejections.store(0, Ordering::Relaxed);
        }
    }

    /// A request failed to connect or got a gateway answer. Returns the ejection it caused, if any;
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
        Some(backoff)
    }
}

#[cfg(test)]
impl Outlier {
    /// The state of a peer whose ejection has just run out.
    fn expire(&self) {
        // An end already past (the clock starts at 0 when first read, 2 ms before the test
        // asks).
        self.ejected_until_ms.store(1, Ordering::Relaxed);
        self.ejections.store(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

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

    /// A reader that finds an old ejection run out must not clear a new one that another
    /// thread starts at the same moment.
    #[test]
    fn a_fresh_ejection_survives_a_reader_of_the_expired_one() {
        let policy = OutlierPolicy {
            consecutive_failures: 1,
            base_ejection: Duration::from_secs(60),
            ..OutlierPolicy::default()
        };
        let p = std::sync::Arc::new(Outlier::default());
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let reader = {
            let (p, stop) = (p.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    p.ejected();
                }
            })
        };
        now_ms();
        std::thread::sleep(Duration::from_millis(2));
        let mut lost = 0;
        for _ in 0..3_000_000 {
            p.expire();
            if p.record_failure(&policy, true).is_some() && !p.ejected() {
                lost += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        reader.join().unwrap();
        assert_eq!(lost, 0, "ejections lost to a concurrent reader");
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
