//! Which peers have recently served a key, and which of them served it last: the warm replicas
//! of a hot prefix, which a spill prefers to a cold peer (Preble's idea), and the peer a
//! conversation that spilled moved to, which holds its newest turns. The record is a fixed table,
//! so its memory is bounded however many keys pass: a key whose entry another key takes is
//! forgotten, which costs one cold prefill, never a wrong answer.
//!
//! It holds hints, not facts: entries are plain atomics without a lock, so two keys racing for
//! one entry may leave it mixed. The worst outcome is one spill priced as warm that was not.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

/// Peers remembered per key.
pub const WAYS: usize = 4;

/// How long a peer is believed to keep a key's prefix after it last served it, in ticks of
/// 100 ms (a minute). An engine evicts by recency under memory pressure, which the balancer
/// cannot see; a minute is what a busy GPU's cache holds of a prefix that stopped coming,
/// roughly.
pub const WARM_TICKS: u32 = 600;

/// How a peer holds a key, as far as the record knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// It served the key last: it holds the newest turns.
    Latest,
    /// It served the key within the last minute, and another one since.
    Earlier,
    No,
}

/// The fresh ways of one key's entry, as read at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Holders {
    ways: [(u32, u32); WAYS],
}

impl Holders {
    /// Whether the record knows of no peer serving the key lately.
    pub fn is_empty(&self) -> bool {
        self.ways.iter().all(|&(serial, _)| serial == 0)
    }

    pub fn of(&self, peer: u32) -> Held {
        let Some(&(_, seen)) = self.ways.iter().find(|&&(serial, _)| serial == peer) else {
            return Held::No;
        };
        if self.ways.iter().all(|&(_, other)| other <= seen) {
            Held::Latest
        } else {
            Held::Earlier
        }
    }
}

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
    /// What was recorded before this tick is forgotten (see [`WarmReplicas::forget`]); what
    /// came in the same tick, before or after, is kept: 100 ms of inexactness.
    floor: AtomicU32,
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
            floor: AtomicU32::new(0),
        }
    }

    fn now(&self) -> u32 {
        // Tick 0 would read as "never served": the clock starts at 1.
        let ticks = self.born.elapsed().as_millis() / 100;
        ticks.min(u128::from(u32::MAX - 1)) as u32 + 1
    }

    fn entry(&self, key: u64) -> &Entry {
        // The key is a Murmur3 hash: its high bits are as good as any and not the ring's.
        let n = self.entries.len() as u64;
        &self.entries[((key >> 32) % n) as usize]
    }

    /// The peers that served `key` in the last minute.
    pub fn holders(&self, key: u64) -> Holders {
        // Most keys never moved and have no entry: they are told without reading the clock.
        if self.entry(key).key.load(Ordering::Relaxed) != key {
            return Holders::default();
        }
        self.holders_at(key, self.now())
    }

    /// Notes that `peer` serves `key` now.
    pub fn record(&self, key: u64, peer: u32) {
        self.record_at(key, peer, self.now());
    }

    /// Forgets everything recorded so far: a peer back in service gets its keys back from
    /// where they moved while it was out, as consistent hashing promises.
    pub fn forget(&self) {
        self.forget_at(self.now());
    }

    fn forget_at(&self, now: u32) {
        self.floor.fetch_max(now, Ordering::Relaxed);
    }

    fn holders_at(&self, key: u64, now: u32) -> Holders {
        let mut held = Holders::default();
        let floor = self.floor.load(Ordering::Relaxed);
        let e = self.entry(key);
        if e.key.load(Ordering::Relaxed) != key {
            return held;
        }
        for (w, out) in e.ways.iter().zip(&mut held.ways) {
            let (serial, seen) = unpack(w.load(Ordering::Relaxed));
            if serial != 0 && seen >= floor && now.saturating_sub(seen) < WARM_TICKS {
                *out = (serial, seen);
            }
        }
        held
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

    fn held(w: &WarmReplicas, key: u64, peer: u32, now: u32) -> Held {
        w.holders_at(key, now).of(peer)
    }

    #[test]
    fn a_served_peer_is_warm_until_it_ages_out() {
        let w = WarmReplicas::with_entries(8);
        assert!(w.holders_at(42, 1).is_empty());
        w.record_at(42, 7, 10);
        assert_eq!(held(&w, 42, 7, 10), Held::Latest);
        assert_eq!(held(&w, 42, 7, 10 + WARM_TICKS - 1), Held::Latest);
        assert_eq!(held(&w, 42, 7, 10 + WARM_TICKS), Held::No);
        assert!(w.holders_at(42, 10 + WARM_TICKS).is_empty());
        assert_eq!(
            held(&w, 42, 8, 10),
            Held::No,
            "only the peer that served it"
        );
        assert_eq!(held(&w, 43, 7, 10), Held::No, "only the key it served");
    }

    #[test]
    fn the_last_server_holds_the_newest_turns() {
        let w = WarmReplicas::with_entries(8);
        w.record_at(42, 1, 5);
        w.record_at(42, 2, 6);
        assert_eq!(held(&w, 42, 2, 6), Held::Latest);
        assert_eq!(held(&w, 42, 1, 6), Held::Earlier);
        w.record_at(42, 1, 7);
        assert_eq!(held(&w, 42, 1, 7), Held::Latest);
        assert_eq!(held(&w, 42, 2, 7), Held::Earlier);
    }

    #[test]
    fn the_longest_unserved_way_makes_room() {
        let w = WarmReplicas::with_entries(8);
        for (peer, at) in [(1, 5), (2, 3), (3, 9), (4, 7)] {
            w.record_at(42, peer, at);
        }
        w.record_at(42, 5, 10);
        assert_eq!(held(&w, 42, 2, 10), Held::No, "served at 3, the oldest");
        for peer in [1, 3, 4, 5] {
            assert_ne!(held(&w, 42, peer, 10), Held::No, "peer {peer}");
        }
        // Serving again refreshes the way rather than taking another.
        w.record_at(42, 1, 11);
        w.record_at(42, 6, 12);
        assert_ne!(held(&w, 42, 1, 12), Held::No);
        assert_eq!(held(&w, 42, 4, 12), Held::No);
    }

    #[test]
    fn forgetting_drops_what_came_before() {
        let w = WarmReplicas::with_entries(8);
        w.record_at(42, 7, 9);
        w.forget_at(10);
        assert!(w.holders_at(42, 11).is_empty());
        w.record_at(42, 8, 11);
        assert_eq!(held(&w, 42, 8, 11), Held::Latest);
        assert_eq!(held(&w, 42, 7, 11), Held::No);
    }

    #[test]
    fn a_key_that_takes_an_entry_forgets_the_one_before() {
        let w = WarmReplicas::with_entries(1);
        w.record_at(1 << 32, 7, 1);
        w.record_at(2 << 32, 8, 1);
        assert!(w.holders_at(1 << 32, 1).is_empty());
        assert_eq!(held(&w, 2 << 32, 8, 1), Held::Latest);
        assert_eq!(
            held(&w, 2 << 32, 7, 1),
            Held::No,
            "the old key's replica is not the new one's"
        );
    }
}
