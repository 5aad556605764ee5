//! The record's fixed table: sets of four entries, each a block's name and the peers (ways)
//! that served it, with the tick they last did. A new block takes the entry of its set that
//! the fewest recent prompts touched (least recently used, by a stamp per recorded prompt), so
//! however many prompts pass, its memory does not grow.
//!
//! A set keeps its four names in its first cache line and each entry's ways in a line of their
//! own: most lookups are of blocks the set does not hold (every new conversation's), and they
//! read one line, where entries stored whole spread the names over four.
//!
//! Entries are plain atomics without a lock, so two prompts racing for one entry may leave it
//! mixed: the worst outcome is one request priced as warm that was not.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Peers remembered per block: a hot system prompt is cached on this many GPUs at most, as far
/// as the record tells.
pub const WAYS: usize = 8;

/// Entries per set.
const SET: usize = 4;

#[derive(Debug, Default)]
#[repr(C, align(64))]
struct Set {
    /// The entries' block names.
    keys: [AtomicU64; SET],
    /// The stamp of the prompt that last served each entry's block: the order a set evicts
    /// in, finer than the ticks.
    touched: [AtomicU32; SET],
    ways: [WayLine; SET],
}

/// One entry's ways: each packs a peer serial (high half) and the tick it last served the
/// block (low).
#[derive(Debug, Default)]
#[repr(align(64))]
struct WayLine([AtomicU64; WAYS]);

/// One entry of a set: a block's name, its ways and its stamp.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'t> {
    set: &'t Set,
    i: usize,
}

/// The fresh ways of one entry, as read at one moment: (serial, tick).
pub type Ways = [(u32, u32); WAYS];

/// Which ways read as fresh: served after `floor`, and fewer than `warm` ticks before `now`.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub now: u32,
    pub floor: u32,
    pub warm: u32,
}

impl<'t> Entry<'t> {
    fn key(self) -> &'t AtomicU64 {
        &self.set.keys[self.i]
    }

    fn ways(self) -> &'t [AtomicU64; WAYS] {
        &self.set.ways[self.i].0
    }

    fn touched(self) -> &'t AtomicU32 {
        &self.set.touched[self.i]
    }

    /// The ways served within `window`; the others read as empty. A way stamped with the very
    /// tick of a forget predates it: the record stamps later ones with the next tick.
    #[inline]
    pub fn fresh(self, window: Window) -> Ways {
        let mut out = Ways::default();
        for (w, o) in self.ways().iter().zip(&mut out) {
            let (serial, seen) = unpack(w.load(Ordering::Relaxed));
            if serial != 0 && seen > window.floor && window.now.saturating_sub(seen) < window.warm {
                *o = (serial, seen);
            }
        }
        out
    }
}

/// Whether `serial` is one of `ways`.
pub fn named(ways: &Ways, serial: u32) -> bool {
    ways.iter().any(|&(s, _)| s == serial)
}

#[derive(Debug)]
pub struct Table {
    sets: Box<[Set]>,
    /// `u64::MAX / sets + 1`, for Lemire's remainder (a set found with two multiplications,
    /// where `%` divides); `None` past 2^32 sets, where it is not exact.
    fastmod: Option<u64>,
    used: AtomicU64,
    evictions: AtomicU64,
    /// Counts recorded prompts, wrapping: each stamps the entries it touches.
    stamps: AtomicU32,
}

impl Table {
    /// A table of at most `bytes` of memory (at least one set).
    pub fn with_bytes(bytes: usize) -> Self {
        let n = (bytes / std::mem::size_of::<Set>()).max(1);
        Self {
            sets: std::iter::repeat_with(Set::default).take(n).collect(),
            fastmod: u32::try_from(n)
                .ok()
                .map(|n| (u64::MAX / u64::from(n)).wrapping_add(1)),
            used: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            stamps: AtomicU32::new(0),
        }
    }

    /// Memory of the table, allocated once.
    pub fn bytes(&self) -> u64 {
        std::mem::size_of_val(&*self.sets) as u64
    }

    pub fn capacity(&self) -> u64 {
        (self.sets.len() * SET) as u64
    }

    /// Entries that hold a block.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Blocks forgotten to make room for others.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    #[inline]
    fn set(&self, hash: u64) -> &Set {
        // Names are Murmur3 hashes: their high bits are as good as any and not the ring's.
        let high = hash >> 32;
        let len = self.sets.len() as u64;
        let i = match self.fastmod {
            // (Lemire, Kaser and Kurz, 2019): exact for a 32-bit dividend and divisor.
            Some(m) => ((u128::from(m.wrapping_mul(high)) * u128::from(len)) >> 64) as u64,
            None => high % len,
        };
        &self.sets[i as usize]
    }

    #[inline]
    pub fn find(&self, hash: u64) -> Option<Entry<'_>> {
        let set = self.set(hash);
        let i = set
            .keys
            .iter()
            .position(|k| k.load(Ordering::Relaxed) == hash)?;
        Some(Entry { set, i })
    }

    /// Notes that `peer` served the blocks named `hashes` at tick `now`, as one prompt.
    // `#[inline]` on the record's path: from another module its per-block calls stayed calls
    // across codegen units (`record` measured 10-40% slower than beside its caller).
    #[inline]
    pub fn record(&self, hashes: &[u64], peer: u32, now: u32) {
        let stamp = self.stamps.fetch_add(1, Ordering::Relaxed);
        for &hash in hashes {
            self.record_at(hash, peer, now, stamp);
        }
    }

    #[inline]
    fn entry_for(&self, hash: u64, stamp: u32) -> Entry<'_> {
        if let Some(e) = self.find(hash) {
            e.touched().store(stamp, Ordering::Relaxed);
            return e;
        }
        let set = self.set(hash);
        let entries = (0..SET).map(|i| Entry { set, i });
        for e in entries.clone() {
            if e.key()
                .compare_exchange(0, hash, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                self.used.fetch_add(1, Ordering::Relaxed);
                e.touched().store(stamp, Ordering::Relaxed);
                return e;
            }
        }
        // The entry served longest ago makes room.
        let age = |e: &Entry| stamp.wrapping_sub(e.touched().load(Ordering::Relaxed));
        let e = entries
            .max_by_key(|e| age(e))
            .unwrap_or(Entry { set, i: 0 });
        e.touched().store(stamp, Ordering::Relaxed);
        e.key().store(hash, Ordering::Relaxed);
        // Its peers held another block, not this one.
        for w in e.ways() {
            w.store(0, Ordering::Relaxed);
        }
        self.evictions.fetch_add(1, Ordering::Relaxed);
        e
    }

    #[inline]
    pub fn record_at(&self, hash: u64, peer: u32, now: u32, stamp: u32) {
        let e = self.entry_for(hash, stamp);
        // The way already naming the peer, else the one served longest ago (empty ways are
        // oldest of all).
        let mut target = 0;
        let mut oldest = u32::MAX;
        for (i, w) in e.ways().iter().enumerate() {
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
        e.ways()[target].store(pack(peer, now), Ordering::Relaxed);
    }
}

impl Table {
    /// Forgets that `peer` served the block named `hash`, if it is still here.
    pub fn forget_way(&self, hash: u64, peer: u32) {
        let Some(e) = self.find(hash) else { return };
        for w in e.ways() {
            let way = w.load(Ordering::Relaxed);
            if unpack(way).0 == peer {
                // Lost to a racing prompt that served the block again: then it is held.
                let _ = w.compare_exchange(way, 0, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
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
    fn a_full_set_forgets_the_block_served_longest_ago() {
        // One set: four entries.
        let r = Table::with_bytes(1);
        assert_eq!(r.capacity(), SET as u64);
        for (block, stamp) in [(1u64, 5), (2, 3), (3, 9), (4, 7)] {
            r.record_at(block << 32, 1, 1, stamp);
        }
        assert_eq!(r.used(), 4);
        r.record_at(5 << 32, 1, 1, 10);
        assert!(r.find(2 << 32).is_none(), "stamped 3, the oldest");
        for block in [1u64, 3, 4, 5] {
            assert!(r.find(block << 32).is_some(), "block {block}");
        }
        let new = r.find(5 << 32).unwrap().fresh(Window {
            now: 1,
            floor: 0,
            warm: 600,
        });
        assert_eq!(
            new.iter().filter(|w| w.0 != 0).count(),
            1,
            "the old block's peers go"
        );
        assert_eq!(r.evictions(), 1);
        assert_eq!(r.used(), 4);
    }

    #[test]
    fn the_budget_sizes_the_table() {
        let r = Table::with_bytes(16 << 20);
        let (bytes, capacity) = (r.bytes(), r.capacity());
        assert!(bytes <= 16 << 20 && bytes > 15 << 20, "{bytes}");
        assert_eq!(capacity * (std::mem::size_of::<Set>() / SET) as u64, bytes);
        // As many entries as when each entry held its name, ways and stamp whole (80 bytes).
        assert_eq!(std::mem::size_of::<Set>(), 80 * SET);
    }
}
