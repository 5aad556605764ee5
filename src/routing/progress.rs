//! Whether a peer's engine is making progress: a wedged engine (one that accepts requests and
//! then sends nothing) still answers its health check, and without this it would keep the
//! keys that land on it until its stuck requests filled its bound.
//!
//! Progress is any byte of any answer from the peer. The proxy marks it on each response
//! header and body chunk, at the cost of a clock read and a store; a sweep off the request path
//! ([`Progress::check`]) decides. A peer is wedged once it has carried requests and sent
//! nothing for the whole limit; it is taken back at its next byte, on the request path, so
//! that recovery waits for no sweep.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use super::clock::now_ms;

/// Not wedged.
const MOVING: u8 = 0;
/// Wedged: takes no new request.
const WEDGED: u8 = 1;
/// Sent a byte since it was wedged; the sweep has not yet said so.
const RECOVERED: u8 = 2;

/// What a sweep found changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Wedged now, after this long without a byte while it carried requests.
    Wedged(Duration),
    /// Moving again.
    Recovered,
}

#[derive(Debug)]
pub struct Progress {
    /// When the peer last sent a byte, or was last seen idle: an idle peer owes nothing, so
    /// its silence counts only from its first request on.
    last_ms: AtomicU64,
    state: AtomicU8,
    /// Times it was found wedged.
    wedges: AtomicU64,
}

impl Default for Progress {
    /// A new peer's silence counts from its creation.
    fn default() -> Self {
        Self {
            last_ms: AtomicU64::new(now_ms()),
            state: AtomicU8::new(MOVING),
            wedges: AtomicU64::new(0),
        }
    }
}

impl Progress {
    /// A byte of an answer came from the peer.
    pub fn advanced(&self) {
        self.last_ms.store(now_ms(), Ordering::Relaxed);
        if self.state.load(Ordering::Relaxed) == WEDGED {
            let _ = self.state.compare_exchange(
                WEDGED,
                RECOVERED,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    /// Whether the peer takes no new request for now.
    pub fn wedged(&self) -> bool {
        self.state.load(Ordering::Relaxed) == WEDGED
    }

    /// Times the peer was found wedged.
    pub fn wedges(&self) -> u64 {
        self.wedges.load(Ordering::Relaxed)
    }

    /// The sweep: `busy` says whether the peer carries requests of this process now. Returns
    /// what changed since the last sweep. A `limit` of zero never wedges.
    pub fn check(&self, busy: bool, limit: Duration) -> Option<Change> {
        let now = now_ms();
        if !busy {
            self.last_ms.store(now, Ordering::Relaxed);
        }
        let state = self.state.load(Ordering::Relaxed);
        if state == RECOVERED {
            let _ = self.state.compare_exchange(
                RECOVERED,
                MOVING,
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
            return Some(Change::Recovered);
        }
        let silent =
            Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Relaxed)));
        if state == MOVING && busy && !limit.is_zero() && silent >= limit {
            // A byte that came between the read of the clock and here wins: the peer stays.
            if self
                .state
                .compare_exchange(MOVING, WEDGED, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                self.wedges.fetch_add(1, Ordering::Relaxed);
                return Some(Change::Wedged(silent));
            }
        }
        if state == WEDGED && !busy {
            // Its stuck requests ended (cut by their clients or by the stream limit): nothing
            // shows it is moving, but nothing is left to show it is not. It is tried again.
            self.state.store(MOVING, Ordering::Relaxed);
            return Some(Change::Recovered);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_millis(30);

    #[test]
    fn a_busy_silent_peer_is_wedged_and_its_next_byte_takes_it_back() {
        let p = Progress::default();
        assert_eq!(p.check(true, LIMIT), None, "silent for less than the limit");
        std::thread::sleep(LIMIT + Duration::from_millis(5));
        assert!(matches!(p.check(true, LIMIT), Some(Change::Wedged(d)) if d >= LIMIT));
        assert!(p.wedged());
        assert_eq!(p.check(true, LIMIT), None, "said once");
        p.advanced();
        assert!(!p.wedged(), "back at once, before any sweep");
        assert_eq!(p.check(true, LIMIT), Some(Change::Recovered));
        assert_eq!(p.check(true, LIMIT), None);
        assert_eq!(p.wedges(), 1);
    }

    #[test]
    fn an_idle_peer_is_never_wedged_and_its_silence_counts_from_its_first_request() {
        let p = Progress::default();
        p.check(false, LIMIT);
        std::thread::sleep(LIMIT + Duration::from_millis(5));
        assert_eq!(p.check(false, LIMIT), None, "idle: owes nothing");
        assert_eq!(p.check(true, LIMIT), None, "busy only since the last sweep");
        assert_eq!(
            p.check(true, Duration::ZERO),
            None,
            "a zero limit never wedges"
        );
    }

    #[test]
    fn a_peer_that_sends_keeps_moving() {
        let p = Progress::default();
        for _ in 0..5 {
            std::thread::sleep(LIMIT / 2);
            p.advanced();
            assert_eq!(p.check(true, LIMIT), None);
        }
    }

    #[test]
    fn a_wedged_peer_whose_requests_ended_is_tried_again() {
        let p = Progress::default();
        std::thread::sleep(LIMIT + Duration::from_millis(5));
        assert!(matches!(p.check(true, LIMIT), Some(Change::Wedged(_))));
        assert_eq!(p.check(false, LIMIT), Some(Change::Recovered));
        assert!(!p.wedged());
    }
}
