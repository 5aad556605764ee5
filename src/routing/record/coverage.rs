//! Whether this process sees the whole of the conversations it routes. Alone in front of its
//! peers (or told by the other processes where they send prompts), the record has seen every
//! conversation before its later turns come; with processes it is not told of, many later
//! turns arrive whose opening went through another one. Only then must a conversation new to
//! the record go where every process would send it (its key's primary); otherwise it may go
//! where it costs least.

use std::sync::atomic::{AtomicU64, Ordering};

/// The share of later turns unseen below which the record is taken as seeing them all: a
/// single process misses only conversations idle past the record's memory (or from before a
/// restart), while a second process sharing the traffic hides half of every second turn.
const ALONE_BELOW: f64 = 0.05;

/// The later turns the share is an average over, about.
const SPAN: u64 = 64;

/// The later turns seen before the share is believed at all.
const SHOWN_AFTER: u64 = 16;

/// Fixed point of the share: `ONE` is all.
const ONE: u64 = 1 << 20;

/// The share of later turns whose conversation the record had not seen: a plain mean of the
/// first [`SPAN`], then an EWMA over about as many. Until [`SHOWN_AFTER`] have come, other
/// processes may be routing.
#[derive(Debug, Default)]
pub struct Coverage {
    /// The turns counted (up to `SPAN`) in the high half, the share in the low one.
    state: AtomicU64,
}

impl Coverage {
    /// Counts one later turn of a conversation, seen by the record before or not.
    pub fn observe(&self, seen: bool) {
        let sample = if seen { 0 } else { ONE as i64 };
        let _ = self
            .state
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |state| {
                let (n, mean) = (
                    (state >> 32).min(SPAN - 1) + 1,
                    (state & 0xffff_ffff) as i64,
                );
                let mean = (mean + (sample - mean) / n as i64) as u64;
                Some(n << 32 | mean)
            });
    }

    /// The share of later turns lately whose conversation the record had not seen; all of
    /// them until enough have come.
    pub fn unseen(&self) -> f64 {
        let state = self.state.load(Ordering::Relaxed);
        if state >> 32 < SHOWN_AFTER {
            return 1.0;
        }
        (state & 0xffff_ffff) as f64 / ONE as f64
    }

    /// Whether the record has lately seen the conversations of (nearly) all later turns.
    pub fn alone(&self) -> bool {
        self.unseen() < ALONE_BELOW
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_alone_once_later_turns_show_it() {
        let c = Coverage::default();
        for _ in 1..SHOWN_AFTER {
            c.observe(true);
        }
        assert!(!c.alone(), "too few shown yet");
        c.observe(true);
        assert!(c.alone(), "{}", c.unseen());
        // An idle conversation forgotten now and then keeps it so.
        for i in 0..4 * SPAN {
            c.observe(i % SPAN != SPAN - 1);
            assert!(c.alone(), "{}", c.unseen());
        }
    }

    #[test]
    fn another_process_sharing_the_traffic_keeps_it_from_being_alone() {
        // Two processes behind a round-robin front: a conversation's second turn reaches the
        // one that sent its opening half the time, its third three times in four.
        let two = |i: u64| i % 4 > 1 || i.is_multiple_of(8);
        let c = Coverage::default();
        for i in 0..4 * SPAN {
            c.observe(two(i));
            assert!(!c.alone(), "{i}: {}", c.unseen());
        }
        // Nor, once alone, does it stay so when another starts sharing it.
        let c = Coverage::default();
        for _ in 0..4 * SPAN {
            c.observe(true);
        }
        for i in 0..SPAN {
            c.observe(two(i));
        }
        assert!(!c.alone(), "{}", c.unseen());
    }
}
