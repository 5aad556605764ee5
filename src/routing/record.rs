//! Where prompts went: for each block of a prompt ([`super::blocks`]), the peers that served a
//! prompt holding it in the last minute. The deepest block of a new prompt that a peer holds is
//! how much of it that peer has cached: the whole history for the peer that served the
//! conversation's last turn, the shared system prompt for the peers that served its department,
//! nothing for the others.
//!
//! The record is a table of a fixed size, set by its memory budget, in sets of four entries: a
//! new block takes the entry of its set that the fewest recent prompts touched (least recently
//! used, by a stamp per recorded prompt). However many prompts pass,
//! its memory does not grow; a forgotten block costs one cold prefill, never a wrong answer.
//! A lookup reads the prompt's first block, then searches the chain by halves for the deepest
//! block each of its peers holds: a few dozen reads at most, whatever the record holds.
//!
//! It holds hints, not facts: entries are plain atomics without a lock, so two prompts racing
//! for one entry may leave it mixed. The worst outcome is one request priced as warm that was
//! not.
//!
//! Several prefixlb processes in front of the same peers each see only the turns that reach
//! them. A record told to share ([`PrefixRecord::share`]) hands each prompt it records to an
//! outbox, which the control plane sends to the others; what they send back is recorded with
//! [`PrefixRecord::record_heard`], and not handed on again.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::Instant;

use super::blocks::Blocks;
use super::cost::{EARLIER_HIT, WARM_HIT};

/// Peers remembered per block: a hot system prompt is cached on this many GPUs at most, as far
/// as the record tells.
pub const WAYS: usize = 8;

/// Entries per set.
const SET: usize = 4;

/// How long a peer is believed to keep a block after it last served it, in ticks of 100 ms (a
/// minute). An engine evicts by recency under memory pressure, which the balancer cannot see;
/// a minute is what a busy GPU's cache holds of a prefix that stopped coming, roughly.
pub const WARM_TICKS: u32 = 600;

/// The record's memory by default: 16 MiB, some 230,000 blocks (a minute of about 3,600 prompts
/// of 64 distinct blocks each, and far more that share their system prompts).
pub const DEFAULT_BYTES: usize = 16 << 20;

#[derive(Debug, Default)]
struct Entry {
    key: AtomicU64,
    /// Each way packs a peer serial (high half) and the tick it last served the block (low).
    ways: [AtomicU64; WAYS],
    /// The stamp of the prompt that last served the block: the order a set evicts in, finer
    /// than the ticks.
    touched: AtomicU32,
}

#[derive(Debug, Default)]
struct Set {
    entries: [Entry; SET],
}

/// The fresh ways of one entry, as read at one moment: (serial, tick).
type Ways = [(u32, u32); WAYS];

#[derive(Debug)]
pub struct PrefixRecord {
    sets: Box<[Set]>,
    born: Instant,
    /// What was recorded before this tick is forgotten (see [`PrefixRecord::forget`]); what
    /// came in the same tick, before or after, is kept: 100 ms of inexactness.
    floor: AtomicU32,
    used: AtomicU64,
    evictions: AtomicU64,
    /// Counts recorded prompts, wrapping: each stamps the entries it touches.
    stamps: AtomicU32,
    /// Where prompts recorded here go for the other processes, once one is set.
    outbox: OnceLock<SyncSender<Served>>,
    /// Prompts the outbox had no room for.
    unsent: AtomicU64,
}

/// A prompt this process sent to a peer (by its serial), for the other processes.
#[derive(Debug, Clone, Copy)]
pub struct Served {
    pub blocks: Blocks,
    pub peer: u32,
}

impl Default for PrefixRecord {
    fn default() -> Self {
        Self::with_bytes(DEFAULT_BYTES)
    }
}

/// What the record counts, for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordStats {
    /// Memory of the table, allocated once.
    pub bytes: u64,
    pub capacity: u64,
    /// Entries that hold a block.
    pub used: u64,
    /// Blocks forgotten to make room for others.
    pub evictions: u64,
    /// Prompts not told to the other processes: their outbox was full.
    pub unsent: u64,
}

/// What the record knows of one prompt: the peers that hold part of it, and how deep.
#[derive(Debug, Clone, Copy, Default)]
pub struct Holdings {
    /// (serial, chain bytes held, tick last served).
    peers: [(u32, u32, u32); WAYS],
    n: usize,
    knows_key: bool,
    bytes: u32,
    key_only: bool,
}

impl Holdings {
    /// Whether no peer served any part of the prompt lately.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Whether some peer holds the prompt up to the end of its key: the record has seen this
    /// conversation, not only its system prompt.
    pub fn knows_key(&self) -> bool {
        self.knows_key
    }

    /// The peer that alone holds the deepest part of the prompt while another holds less of
    /// it: where a conversation's own turns are, past a part it shares with others (or past
    /// where it was before it moved).
    pub fn conversation_home(&self) -> Option<u32> {
        // Peers are listed deepest first.
        match self.peers[..self.n] {
            [(serial, deepest, _), (_, next, _), ..] if deepest > next => Some(serial),
            _ => None,
        }
    }

    /// Whether two peers or more hold the deepest part of the prompt that anyone holds: a
    /// prefix shared by conversations, not one conversation's own turns.
    pub fn deepest_is_shared(&self) -> bool {
        // Peers are listed deepest first.
        matches!(self.peers[..self.n], [(_, a, _), (_, b, _), ..] if a == b)
    }

    pub fn holds(&self, serial: u32) -> bool {
        self.peers[..self.n].iter().any(|&(s, _, _)| s == serial)
    }

    /// The share of the prompt `serial` is expected to hold (`α`, 0 to 1). Of a prompt known by
    /// its key alone, the peer that served it last holds all but the newest turn, one that
    /// served it earlier the turns up to then.
    pub fn share(&self, serial: u32) -> f64 {
        let Some(&(_, depth, seen)) = self.peers[..self.n].iter().find(|p| p.0 == serial) else {
            return 0.0;
        };
        if self.key_only {
            let latest = self.peers[..self.n].iter().all(|p| p.2 <= seen);
            return if latest { WARM_HIT } else { EARLIER_HIT };
        }
        (f64::from(depth) / f64::from(self.bytes.max(1))).min(1.0)
    }
}

impl PrefixRecord {
    /// A record of at most `bytes` of memory (at least one set).
    pub fn with_bytes(bytes: usize) -> Self {
        let n = (bytes / std::mem::size_of::<Set>()).max(1);
        Self {
            sets: std::iter::repeat_with(Set::default).take(n).collect(),
            born: Instant::now(),
            floor: AtomicU32::new(0),
            used: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            stamps: AtomicU32::new(0),
            outbox: OnceLock::new(),
            unsent: AtomicU64::new(0),
        }
    }

    /// Hands every prompt recorded from now on to `outbox` as well. A full outbox drops the
    /// prompt (counted): the request path never waits for the other processes. False when an
    /// outbox was set already.
    pub fn share(&self, outbox: SyncSender<Served>) -> bool {
        self.outbox.set(outbox).is_ok()
    }

    pub fn stats(&self) -> RecordStats {
        RecordStats {
            bytes: std::mem::size_of_val(&*self.sets) as u64,
            capacity: (self.sets.len() * SET) as u64,
            used: self.used.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            unsent: self.unsent.load(Ordering::Relaxed),
        }
    }

    fn now(&self) -> u32 {
        // Tick 0 would read as "never served": the clock starts at 1.
        let ticks = self.born.elapsed().as_millis() / 100;
        ticks.min(u128::from(u32::MAX - 1)) as u32 + 1
    }

    fn set(&self, hash: u64) -> &Set {
        // Names are Murmur3 hashes: their high bits are as good as any and not the ring's.
        &self.sets[((hash >> 32) % self.sets.len() as u64) as usize]
    }

    fn find(&self, hash: u64) -> Option<&Entry> {
        self.set(hash)
            .entries
            .iter()
            .find(|e| e.key.load(Ordering::Relaxed) == hash)
    }

    /// How much of the prompt named by `blocks` each peer that served part of it lately holds.
    pub fn holdings(&self, blocks: &Blocks) -> Holdings {
        let mut out = Holdings {
            bytes: blocks.bytes(),
            key_only: blocks.key_only(),
            ..Holdings::default()
        };
        // Most first blocks are unknown or known at once: an unknown one without the clock.
        let Some(first) = blocks.hashes().first().and_then(|&h| self.find(h)) else {
            return out;
        };
        let (now, floor) = (self.now(), self.floor.load(Ordering::Relaxed));
        let at_first = fresh(first, now, floor);
        let mut left: Ways = at_first;
        let remains = |left: &Ways| left.iter().any(|&(s, _)| s != 0);
        let mut deepest = None;
        let mut top = blocks.len();
        while remains(&left) {
            // Each peer holds a prompt's blocks from the first to its deepest (they are
            // recorded together), so "some peer left holds point i" holds up to the deepest
            // of theirs and no further.
            let (mut lo, mut hi, mut at_lo) = (0, top, at_first);
            while lo + 1 < hi {
                let mid = (lo + hi) / 2;
                let ways = self
                    .find(blocks.hash(mid))
                    .map(|e| fresh(e, now, floor))
                    .unwrap_or_default();
                if ways.iter().any(|&(s, _)| s != 0 && named(&left, s)) {
                    (lo, at_lo) = (mid, ways);
                } else {
                    hi = mid;
                }
            }
            // The first round finds the deepest point anyone holds.
            deepest.get_or_insert(lo);
            // At least one peer left is named at `lo` (all of them at point 0): each round
            // takes one depth, and the rest hold less.
            for l in left.iter_mut().filter(|l| l.0 != 0) {
                if let Some(&(_, seen)) = at_lo.iter().find(|w| w.0 == l.0) {
                    out.peers[out.n] = (l.0, blocks.end(lo), seen);
                    out.n += 1;
                    *l = (0, 0);
                }
            }
            top = lo;
        }
        out.knows_key = matches!((blocks.key_point(), deepest), (Some(k), Some(d)) if d >= k);
        out
    }

    /// Notes that `peer` serves the prompt named by `blocks` now, and tells the other
    /// processes when sharing.
    pub fn record(&self, blocks: &Blocks, peer: u32) {
        if blocks.is_empty() {
            return;
        }
        self.record_heard(blocks.hashes(), peer);
        if let Some(outbox) = self.outbox.get() {
            let served = Served {
                blocks: *blocks,
                peer,
            };
            if let Err(TrySendError::Full(_)) = outbox.try_send(served) {
                self.unsent.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Notes that `peer` serves the prompt whose blocks are named `hashes` (shallowest
    /// first), without telling the other processes: what one of them told this one (and the
    /// recording half of [`PrefixRecord::record`]).
    pub fn record_heard(&self, hashes: &[u64], peer: u32) {
        // What is served after a forget counts from the tick after it, which the forget's
        // own tick does not reach (see `fresh`).
        let now = self.now().max(self.floor.load(Ordering::Relaxed) + 1);
        let stamp = self.stamps.fetch_add(1, Ordering::Relaxed);
        for &hash in hashes {
            self.record_at(hash, peer, now, stamp);
        }
    }

    /// Forgets everything recorded so far: a peer back in service gets its keys back from
    /// where they moved while it was out, as consistent hashing promises.
    pub fn forget(&self) {
        self.forget_at(self.now());
    }

    fn forget_at(&self, now: u32) {
        self.floor.fetch_max(now, Ordering::Relaxed);
    }

    fn entry_for(&self, hash: u64, stamp: u32) -> &Entry {
        if let Some(e) = self.find(hash) {
            e.touched.store(stamp, Ordering::Relaxed);
            return e;
        }
        let set = self.set(hash);
        for e in &set.entries {
            if e.key
                .compare_exchange(0, hash, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                self.used.fetch_add(1, Ordering::Relaxed);
                e.touched.store(stamp, Ordering::Relaxed);
                return e;
            }
        }
        // The entry served longest ago makes room.
        let age = |e: &Entry| stamp.wrapping_sub(e.touched.load(Ordering::Relaxed));
        let e = set
            .entries
            .iter()
            .max_by_key(|e| age(e))
            .unwrap_or(&set.entries[0]);
        e.touched.store(stamp, Ordering::Relaxed);
        e.key.store(hash, Ordering::Relaxed);
        // Its peers held another block, not this one.
        for w in &e.ways {
            w.store(0, Ordering::Relaxed);
        }
        self.evictions.fetch_add(1, Ordering::Relaxed);
        e
    }

    fn record_at(&self, hash: u64, peer: u32, now: u32, stamp: u32) {
        let e = self.entry_for(hash, stamp);
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

/// The ways of `e` served after `floor` and within the last minute; the others read as empty.
/// A way stamped with the very tick of a `forget` predates it: `record` stamps later ones with
/// the next tick.
fn fresh(e: &Entry, now: u32, floor: u32) -> Ways {
    let mut out = Ways::default();
    for (w, o) in e.ways.iter().zip(&mut out) {
        let (serial, seen) = unpack(w.load(Ordering::Relaxed));
        if serial != 0 && seen > floor && now.saturating_sub(seen) < WARM_TICKS {
            *o = (serial, seen);
        }
    }
    out
}

fn named(ways: &Ways, serial: u32) -> bool {
    ways.iter().any(|&(s, _)| s == serial)
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
    use crate::routing::blocks::ChainEncoder;

    /// A prompt of `parts`, each `len` bytes of its letter, whose key is its first two parts
    /// (a system prompt and the first question).
    fn prompt(parts: &[(u8, usize)]) -> Blocks {
        let mut c = ChainEncoder::default();
        for (i, &(letter, len)) in parts.iter().enumerate() {
            c.write(&vec![letter; len]);
            if i == 1 {
                c.key_ends();
            }
        }
        c.finish()
    }

    #[test]
    fn a_sharing_record_hands_on_what_it_records_and_not_what_it_hears() {
        let (one, two) = (PrefixRecord::default(), PrefixRecord::default());
        let (outbox, sent) = std::sync::mpsc::sync_channel(1);
        assert!(one.share(outbox.clone()));
        assert!(!one.share(outbox), "an outbox is set once");
        let turn = prompt(&[(b's', 3_000), (b'q', 100), (b'a', 2_000)]);
        one.record(&turn, 3);
        let served = sent.try_recv().expect("handed on");
        assert_eq!((served.blocks, served.peer), (turn, 3));
        // Another process records it as heard: the same holdings, and nothing handed on.
        two.record_heard(served.blocks.hashes(), 3);
        let (a, b) = (one.holdings(&turn), two.holdings(&turn));
        assert_eq!((a.share(3), a.knows_key()), (b.share(3), b.knows_key()));
        let held = b.share(3);
        assert!(held > 0.5, "{held}");
        one.record_heard(turn.hashes(), 4);
        assert!(sent.try_recv().is_err(), "a heard prompt was handed on");
        // A full outbox drops the prompt and counts it; the record has it all the same.
        one.record(&turn, 5);
        one.record(&turn, 6);
        assert_eq!(one.stats().unsent, 1);
        assert_eq!(one.holdings(&turn).share(6), held);
    }

    fn holdings_at(r: &PrefixRecord, b: &Blocks, now: u32) -> Holdings {
        // `holdings` reads the clock; a test's record is a fresh one, a few ticks old at most.
        assert!(now <= r.now() + WARM_TICKS);
        r.holdings(b)
    }

    #[test]
    fn a_conversation_has_a_home_once_it_goes_deeper_than_its_shared_part() {
        let r = PrefixRecord::with_bytes(1 << 20);
        let system = (b's', 20_000);
        let turn1 = prompt(&[system, (b'a', 3_000)]);
        let turn2 = prompt(&[system, (b'a', 3_000), (b'b', 3_000)]);
        let fresh = prompt(&[system, (b'c', 3_000)]);
        r.record(&turn1, 1);
        // Known to one peer only: it may be a shared prefix seen once.
        assert_eq!(r.holdings(&turn2).conversation_home(), None);
        assert!(!r.holdings(&turn2).deepest_is_shared());
        r.record(&prompt(&[system, (b'z', 5_000)]), 2);
        assert_eq!(r.holdings(&turn2).conversation_home(), Some(1));
        // A new conversation meets the system prompt on both, as deep on each.
        let h = r.holdings(&fresh);
        assert_eq!(h.conversation_home(), None);
        assert!(h.deepest_is_shared());
    }

    #[test]
    fn each_peer_holds_a_prompt_as_deep_as_it_served_it() {
        let r = PrefixRecord::with_bytes(1 << 20);
        let system = (b's', 20_000);
        let turn1 = prompt(&[system, (b'a', 3_000)]);
        let turn2 = prompt(&[system, (b'a', 3_000), (b'b', 3_000)]);
        let other = prompt(&[system, (b'z', 5_000)]);
        r.record(&turn1, 1);
        r.record(&other, 2);
        let h = r.holdings(&turn2);
        // Peer 1 holds turn 1 to its key's end (23,000 bytes, past its 22 whole blocks), peer
        // 2 the whole blocks of the system prompt (20,000 bytes: 19).
        let bytes = f64::from(turn2.bytes());
        assert!(
            (h.share(1) - 23_000.0 / bytes).abs() < 1e-9,
            "{}",
            h.share(1)
        );
        assert!(
            (h.share(2) - 19.0 * 1024.0 / bytes).abs() < 1e-9,
            "{}",
            h.share(2)
        );
        assert_eq!(h.share(3), 0.0);
        assert!(h.holds(1) && h.holds(2) && !h.holds(3));
        assert!(h.knows_key(), "peer 1 served it to its key's end");
        let new = prompt(&[system, (b'q', 2_000)]);
        let h = r.holdings(&new);
        assert!(!h.knows_key(), "only its system prompt was served");
        assert!(h.share(1) > 0.8 && h.share(2) > 0.8);
        assert!(r.holdings(&prompt(&[(b'x', 9_000)])).is_empty());
    }

    #[test]
    fn a_prompt_known_by_its_key_alone_is_held_by_who_served_it_last() {
        let r = PrefixRecord::with_bytes(1 << 20);
        let key = Blocks::of_key(42 << 32);
        r.record_at(key.hash(0), 1, 5, 0);
        r.record_at(key.hash(0), 2, 6, 1);
        let h = holdings_at(&r, &key, 6);
        assert_eq!(h.share(2), WARM_HIT);
        assert_eq!(h.share(1), EARLIER_HIT);
        assert!(h.knows_key());
    }

    #[test]
    fn a_served_block_is_warm_until_it_ages_out_or_is_forgotten() {
        let r = PrefixRecord::with_bytes(1 << 20);
        r.record_at(7, 1, 10, 0);
        let at = |now| fresh(r.find(7).unwrap(), now, r.floor.load(Ordering::Relaxed));
        assert!(named(&at(10 + WARM_TICKS - 1), 1));
        assert!(!named(&at(10 + WARM_TICKS), 1));
        r.forget_at(11);
        assert!(!named(&at(12), 1));
        r.record_at(7, 2, 12, 1);
        assert!(named(&at(12), 2) && !named(&at(12), 1));
        // Served in the tick of a forget, before it: forgotten; after it: kept.
        r.record_at(7, 3, 13, 2);
        r.forget_at(13);
        assert!(!named(&at(13), 3) && !named(&at(14), 3));
        let r = PrefixRecord::with_bytes(1 << 20);
        r.forget();
        let blocks = Blocks::of_key(7 << 32);
        r.record(&blocks, 4);
        assert!(r.holdings(&blocks).holds(4));
    }

    #[test]
    fn a_full_set_forgets_the_block_served_longest_ago() {
        // One set: four entries.
        let r = PrefixRecord::with_bytes(1);
        assert_eq!(r.stats().capacity, SET as u64);
        for (block, stamp) in [(1u64, 5), (2, 3), (3, 9), (4, 7)] {
            r.record_at(block << 32, 1, 1, stamp);
        }
        assert_eq!(r.stats().used, 4);
        r.record_at(5 << 32, 1, 1, 10);
        assert!(r.find(2 << 32).is_none(), "stamped 3, the oldest");
        for block in [1u64, 3, 4, 5] {
            assert!(r.find(block << 32).is_some(), "block {block}");
        }
        let new = fresh(r.find(5 << 32).unwrap(), 1, 0);
        assert_eq!(
            new.iter().filter(|w| w.0 != 0).count(),
            1,
            "the old block's peers go"
        );
        assert_eq!(r.stats().evictions, 1);
        assert_eq!(r.stats().used, 4);
    }

    #[test]
    fn the_budget_sizes_the_table() {
        let r = PrefixRecord::with_bytes(16 << 20);
        let s = r.stats();
        assert!(s.bytes <= 16 << 20 && s.bytes > 15 << 20, "{s:?}");
        assert_eq!(s.capacity * std::mem::size_of::<Entry>() as u64, s.bytes);
    }
}
