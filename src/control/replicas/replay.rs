//! Which signed datagrams were heard already, so that a copy sent again is not: per sender, the
//! highest sequence number heard and which of the [`WINDOW`] before it were (the sliding window
//! of IPsec, RFC 4303 §3.4.3). UDP may reorder datagrams; one late by less than the window is
//! still heard, once. A sender is known by the id it draws at its start, so that one restarted
//! or upgraded, counting from 0 again, is heard as a new sender rather than as a replay.
//!
//! The windows live in memory and hold [`MAX_SENDERS`]: a receiver that restarted, or a copy
//! of a sender long forgotten, would find no window. So a datagram is also heard only within
//! [`MAX_AGE`] of the time it says it was sent ([`fresh`]): a copy is heard at most once, and
//! only while what it says is still about as new as the record's own turns.

use std::collections::HashMap;
use std::time::Duration;

/// How far from this process's clock the time a datagram was sent may be, either way: the
/// network's delay and the replicas' clocks apart (NTP keeps them within milliseconds).
pub const MAX_AGE: Duration = Duration::from_secs(30);

/// Whether a datagram sent at `sent_ms` is heard at `now_ms` (both since the Unix epoch).
pub fn fresh(sent_ms: u64, now_ms: u64) -> bool {
    u128::from(sent_ms.abs_diff(now_ms)) <= MAX_AGE.as_millis()
}

/// Sequence numbers below the highest heard that are still told apart.
pub const WINDOW: u64 = 64;

/// Senders remembered at most; more than the replicas and an upgrade's processes ever are.
/// The one heard from least recently is forgotten for a new one.
pub const MAX_SENDERS: usize = 64;

/// One sender's window.
#[derive(Debug, Clone, Copy)]
struct Window {
    top: u64,
    /// Bit `i`: sequence number `top - i` was heard.
    seen: u64,
}

impl Window {
    fn new(seq: u64) -> Self {
        Self { top: seq, seen: 1 }
    }

    /// Whether `seq` is heard for the first time (and then notes it).
    fn admit(&mut self, seq: u64) -> bool {
        if seq > self.top {
            let ahead = seq - self.top;
            self.seen = if ahead >= WINDOW {
                1
            } else {
                self.seen << ahead | 1
            };
            self.top = seq;
            return true;
        }
        let back = self.top - seq;
        if back >= WINDOW {
            return false;
        }
        let bit = 1 << back;
        let first = self.seen & bit == 0;
        self.seen |= bit;
        first
    }
}

/// The windows of the senders heard lately.
#[derive(Debug, Default)]
pub struct Senders {
    /// Each sender's window, and when it was last heard (a count of datagrams heard).
    windows: HashMap<u64, (Window, u64)>,
    heard: u64,
}

impl Senders {
    /// Whether datagram `seq` of `sender` is heard for the first time (and then notes it).
    /// Called only for datagrams whose signature matches: a forger cannot move a window.
    pub fn admit(&mut self, sender: u64, seq: u64) -> bool {
        self.heard += 1;
        if let Some((window, last)) = self.windows.get_mut(&sender) {
            let first = window.admit(seq);
            if first {
                *last = self.heard;
            }
            return first;
        }
        if self.windows.len() >= MAX_SENDERS {
            let oldest = self.windows.iter().min_by_key(|(_, (_, last))| *last);
            if let Some((&gone, _)) = oldest {
                self.windows.remove(&gone);
            }
        }
        self.windows.insert(sender, (Window::new(seq), self.heard));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_datagram_is_heard_only_near_the_time_it_says_it_was_sent() {
        let now = 1_796_000_000_000;
        let age = MAX_AGE.as_millis() as u64;
        for heard in [now, now - age, now + age, now - 5] {
            assert!(fresh(heard, now), "{heard}");
        }
        for stale in [now - age - 1, now + age + 1, 0, u64::MAX] {
            assert!(!fresh(stale, now), "{stale}");
        }
    }

    #[test]
    fn each_sequence_number_is_heard_once() {
        let mut s = Senders::default();
        assert!(s.admit(1, 10));
        assert!(!s.admit(1, 10), "a duplicate");
        assert!(s.admit(1, 11));
        assert!(!s.admit(1, 11));
    }

    #[test]
    fn a_datagram_reordered_within_the_window_is_heard_once() {
        let mut s = Senders::default();
        assert!(s.admit(1, 100));
        assert!(s.admit(1, 105));
        for late in [104, 101, 103, 102] {
            assert!(s.admit(1, late), "{late} came late");
            assert!(!s.admit(1, late), "{late} again");
        }
        // The oldest the window still tells apart, then one past it.
        assert!(s.admit(1, 105 - (WINDOW - 1)));
        assert!(!s.admit(1, 105 - WINDOW), "older than the window");
        assert!(!s.admit(1, 0));
    }

    #[test]
    fn a_jump_past_the_window_forgets_what_was_heard_before_it() {
        let mut s = Senders::default();
        for seq in 0..10 {
            assert!(s.admit(1, seq));
        }
        assert!(s.admit(1, 10 + WINDOW));
        assert!(!s.admit(1, 9), "now older than the window");
        assert!(!s.admit(1, 10), "never heard, but older than the window");
        assert!(s.admit(1, 11), "the oldest the window holds");
        assert!(!s.admit(1, 10 + WINDOW));
        assert!(s.admit(1, u64::MAX));
        assert!(!s.admit(1, u64::MAX));
    }

    #[test]
    fn senders_are_told_apart_and_a_restarted_one_counts_afresh() {
        let mut s = Senders::default();
        assert!(s.admit(1, 500));
        assert!(s.admit(2, 0), "another sender's 0");
        assert!(!s.admit(1, 0), "too old for sender 1");
        assert!(s.admit(3, 0), "sender 1 restarted, under a new id");
    }

    #[test]
    fn the_sender_heard_least_recently_is_forgotten_for_a_new_one() {
        let mut s = Senders::default();
        for sender in 0..MAX_SENDERS as u64 {
            assert!(s.admit(sender, 5));
        }
        // Sender 0 is heard again: sender 1 is now the one heard least recently.
        assert!(s.admit(0, 6));
        assert!(!s.admit(1, 5), "a replay heard no more recently");
        assert!(s.admit(1000, 0));
        assert_eq!(s.windows.len(), MAX_SENDERS);
        assert!(!s.admit(0, 6), "sender 0 was kept");
        assert!(!s.admit(2, 5), "sender 2 was kept");
        assert!(
            s.admit(1, 5),
            "sender 1 was forgotten: its replay is new to the window"
        );
    }
}
