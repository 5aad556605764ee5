//! Which peers other than its primary have recently served a key: the warm replicas of a hot
//! prefix, which a spill prefers to a cold peer (Preble's idea). The record is a fixed table,
//! so its memory is bounded however many keys pass: a key whose entry another key takes is
//! forgotten, which costs one cold prefill, never a wrong answer.
//!
//! It holds hints, not facts: entries are plain atomics without a lock, so two keys racing for
//! one entry may leave it mixed. The worst outcome is one spill priced as warm that was not.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Peers remembered per key besides its primary.
pub const WAYS: usize = 4;

/// How long a peer is believed to keep a key's prefix after it last served it. An engine evicts
/// by recency under memory pressure, which the balancer cannot see; a minute is what a busy
/// GPU's cache holds of a prefix that stopped coming, roughly.
pub const WARM_SECS: u32 = 60;

/// Entries of the table by default: 2^16, about 2.6 MiB.
pub const DEFAULT_ENTRIES: usize = 1 << 16;

#[derive(Debug, Default)]
struct Entry {
    key: AtomicU64,
    /// Each way packs a peer serial (high half) and the second it last served the key (low).
    ways: [AtomicU64; WAYS],
}

#[derive(Debug)]
pub struct WarmReplicas {
    entries: Box<[Entry]>,
    born: Instant,
}

impl Default for WarmReplicas {
    fn default() -> Self {
        Self::with_entries(DEFAULT_ENTRIES)
    }
}

impl WarmReplicas {
    /// A record of `entries` keys at most (rounded up to a power of two).
    pub fn with_entries(entries: usize) -> Self {
        let n = entries.max(1).next_power_of_two();
        Self {
            entries: std::iter::repeat_with(Entry::default).take(n).collect(),
            born: Instant::now(),
        }
    }

    fn now(&self) -> u32 {
        // Second 0 would read as "never served": the clock starts at 1.
        self.born.elapsed().as_secs().min(u64::from(u32::MAX - 1)) as u32 + 1
    }

    fn entry(&self, key: u64) -> &Entry {
        // The key is a Murmur3 hash: its high bits are as good as any and not the ring's.
        let n = self.entries.len() as u64;
        &self.entries[((key >> 32) % n) as usize]
    }

    /// Whether `peer` (a serial) served `key` in the last [`WARM_SECS`].
    pub fn is_warm(&self, key: u64, peer: u32) -> bool {
        self.is_warm_at(key, peer, self.now())
    }

    /// Notes that `peer` serves `key` now.
    pub fn record(&self, key: u64, peer: u32) {
        self.record_at(key, peer, self.now());
    }

    fn is_warm_at(&self, key: u64, peer: u32, now: u32) -> bool {
        let e = self.entry(key);
        if e.key.load(Ordering::Relaxed) != key {
            return false;
        }
        e.ways.iter().any(|w| {
            let (serial, seen) = unpack(w.load(Ordering::Relaxed));
            serial == peer && now.saturating_sub(seen) < WARM_SECS
        })
    }

    fn record_at(&self, key: u64, peer: u32, now: u32) {
        let e = self.entry(key);
        if e.key.swap(key, Ordering::Relaxed) != key {
            // The entry held another key: its replicas say nothing of this one.
            for w in &e.ways {
                w.store(0, Ordering::Relaxed);
            }
        }
        // The way already naming the peer, else the one served longest ago (empty ways are
        // oldest of all).
        let mut target = 0;
        let mut oldest = u32::MAX;
        for (i, w) in e.ways.iter().enumerate() {
            let (serial, seen) = unpack(w.load(Ordering::Relaxed));
            if serial == peer {
                target = i;
                break;
            }
            if seen < oldest {
                oldest = seen;
                target = i;
            }
        }
        e.ways[target].store(pack(peer, now), Ordering::Relaxed);
    }
}

fn pack(serial: u32, seen: u32) -> u64 {
    (u64::from(serial) << 32) | u64::from(seen)
}

fn unpack(way: u64) -> (u32, u32) {
    ((way >> 32) as u32, way as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_served_peer_is_warm_until_it_ages_out() {
        let w = WarmReplicas::with_entries(8);
        assert!(!w.is_warm_at(42, 7, 1));
        w.record_at(42, 7, 10);
        assert!(w.is_warm_at(42, 7, 10));
        assert!(w.is_warm_at(42, 7, 10 + WARM_SECS - 1));
        assert!(!w.is_warm_at(42, 7, 10 + WARM_SECS));
        assert!(!w.is_warm_at(42, 8, 10), "only the peer that served it");
        assert!(!w.is_warm_at(43, 7, 10), "only the key it served");
    }

    #[test]
    fn the_longest_unserved_way_makes_room() {
        let w = WarmReplicas::with_entries(8);
        for (peer, at) in [(1, 5), (2, 3), (3, 9), (4, 7)] {
            w.record_at(42, peer, at);
        }
        w.record_at(42, 5, 10);
        assert!(!w.is_warm_at(42, 2, 10), "served at 3, the oldest");
        for peer in [1, 3, 4, 5] {
            assert!(w.is_warm_at(42, peer, 10), "peer {peer}");
        }
        // Serving again refreshes the way rather than taking another.
        w.record_at(42, 1, 11);
        w.record_at(42, 6, 12);
        assert!(w.is_warm_at(42, 1, 12) && !w.is_warm_at(42, 4, 12));
    }

    #[test]
    fn a_key_that_takes_an_entry_forgets_the_one_before() {
        let w = WarmReplicas::with_entries(1);
        w.record_at(1 << 32, 7, 1);
        w.record_at(2 << 32, 8, 1);
        assert!(!w.is_warm_at(1 << 32, 7, 1));
        assert!(w.is_warm_at(2 << 32, 8, 1));
        assert!(
            !w.is_warm_at(2 << 32, 7, 1),
            "the old key's replica is not the new one's"
        );
    }
}
