//! Where prompts went: for each block of a prompt ([`crate::routing::blocks`]), the peers that
//! served a prompt holding it lately (the tuning's `warm_for`, a minute by default). The
//! deepest block of a new prompt that a peer holds is how much of it that peer has cached: the
//! whole history for the peer that served the conversation's last turn, the shared system
//! prompt for the peers that served its department, nothing for the others.
//!
//! The record is a table of a fixed size, set by its memory budget ([`table`]); a forgotten
//! block costs one cold prefill, never a wrong answer. It holds hints, not facts: what it
//! answers of a prompt ([`Holdings`]) may be a little off when prompts race.
//!
//! Several prefixlb processes in front of the same peers each see only the turns that reach
//! them. A record told to share ([`PrefixRecord::share`]) hands each prompt it records to an
//! outbox, which the control plane sends to the others; what they send back is recorded with
//! [`PrefixRecord::record_heard`], and not handed on again.

mod coverage;
mod holdings;
mod table;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub use coverage::Coverage;
pub use holdings::{Holdings, KeyHits};
pub use table::WAYS;

use crate::routing::blocks::Blocks;
use crate::routing::tuning::Tuning;
use table::{Table, Window};

/// The record's memory by default: 16 MiB, some 230,000 blocks (a minute of about 3,600 prompts
/// of 64 distinct blocks each, and far more that share their system prompts).
pub const DEFAULT_BYTES: usize = 16 << 20;

/// The record's clock ticks every 100 ms: `warm_for` in ticks.
const fn ticks(warm_for: Duration) -> u32 {
    let ticks = warm_for.as_millis() / 100;
    if ticks > u32::MAX as u128 {
        u32::MAX
    } else {
        ticks as u32
    }
}

#[derive(Debug)]
pub struct PrefixRecord {
    table: Table,
    born: Instant,
    /// What was recorded before this tick is forgotten (see [`PrefixRecord::forget`]); what
    /// came in the same tick, before or after, is kept: 100 ms of inexactness.
    floor: AtomicU32,
    /// How long a peer is believed to keep a block after it last served it, in ticks.
    warm_ticks: u32,
    key_hits: KeyHits,
    /// Where prompts recorded here go for the other processes, once one is set.
    outbox: OnceLock<SyncSender<Served>>,
    /// Prompts the outbox had no room for.
    unsent: AtomicU64,
    pub coverage: Coverage,
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

impl PrefixRecord {
    /// A record of at most `bytes` of memory (at least one set), with the default tuning.
    pub fn with_bytes(bytes: usize) -> Self {
        Self {
            table: Table::with_bytes(bytes),
            born: Instant::now(),
            floor: AtomicU32::new(0),
            warm_ticks: 0,
            key_hits: KeyHits::default(),
            outbox: OnceLock::new(),
            unsent: AtomicU64::new(0),
            coverage: Coverage::default(),
        }
        .tuned(&Tuning::DEFAULT)
    }

    /// The same record, reading its figures (how long a block stays warm, what a prompt known
    /// by its key alone is held as) from `tuning`.
    pub fn tuned(self, tuning: &Tuning) -> Self {
        Self {
            warm_ticks: ticks(tuning.warm_for),
            key_hits: KeyHits {
                last: tuning.warm_hit,
                earlier: tuning.earlier_hit,
            },
            ..self
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
            bytes: self.table.bytes(),
            capacity: self.table.capacity(),
            used: self.table.used(),
            evictions: self.table.evictions(),
            unsent: self.unsent.load(Ordering::Relaxed),
        }
    }

    fn now(&self) -> u32 {
        self.tick(Instant::now())
    }

    /// The tick of `at`.
    fn tick(&self, at: Instant) -> u32 {
        let age = at.saturating_duration_since(self.born);
        // `as_millis() / 100`, without its division of a u128 (a call, on every record).
        let ticks = age.as_secs().saturating_mul(10) + u64::from(age.subsec_millis() / 100);
        // Tick 0 would read as "never served": the clock starts at 1.
        ticks.min(u64::from(u32::MAX - 1)) as u32 + 1
    }

    /// How much of the prompt named by `blocks` each peer that served part of it lately holds.
    pub fn holdings(&self, blocks: &Blocks) -> Holdings {
        let window = || Window {
            now: self.now(),
            floor: self.floor.load(Ordering::Relaxed),
            warm: self.warm_ticks,
        };
        Holdings::search(&self.table, blocks, window, self.key_hits)
    }

    /// Notes that `peer` serves the prompt named by `blocks` now, and tells the other
    /// processes when sharing.
    pub fn record(&self, blocks: &Blocks, peer: u32) {
        if !blocks.is_empty() {
            self.record_at(blocks, peer, Instant::now());
        }
    }

    /// [`PrefixRecord::record`] as of `at`: a decision that read the clock for its slot reads
    /// it once.
    pub fn record_at(&self, blocks: &Blocks, peer: u32, at: Instant) {
        if blocks.is_empty() {
            return;
        }
        self.note(blocks.hashes(), peer, self.tick(at));
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
        self.note(hashes, peer, self.now());
    }

    fn note(&self, hashes: &[u64], peer: u32, now: u32) {
        // What is served after a forget counts from the tick after it, which the forget's
        // own tick does not reach (see the table's `Entry::fresh`).
        let now = now.max(self.floor.load(Ordering::Relaxed) + 1);
        self.table.record(hashes, peer, now);
    }

    /// Notes that `peer` held only `held` (0 to 1) of the prompt named by `blocks` when it was
    /// last sent there, although the record said it held more: its engine evicts faster than
    /// the record forgets. What lies beyond is forgotten there, so that the conversation's
    /// next turn is priced cold on it, and may go where that is cheaper. The blocks up to the
    /// key's end stay: they name the conversation as seen, so that its next turn is priced at
    /// what the peer holds instead of assumed held, as a key never seen is on its primary. A
    /// key alone has nothing to measure and is forgotten whole.
    pub fn evicted(&self, blocks: &Blocks, peer: u32, held: f64) {
        let kept = f64::from(blocks.bytes()) * held.clamp(0.0, 1.0);
        let whole = blocks.key_only();
        for i in 0..blocks.len() {
            let beyond =
                f64::from(blocks.end(i)) > kept && blocks.key_point().is_none_or(|k| i > k);
            if whole || beyond {
                self.table.forget_way(blocks.hash(i), peer);
            }
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
}

#[cfg(test)]
mod tests {
    use super::table::named;
    use super::*;
    use crate::routing::blocks::ChainEncoder;

    const WARM_TICKS: u32 = ticks(Tuning::DEFAULT.warm_for);

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
        r.table.record_at(key.hash(0), 1, 5, 0);
        r.table.record_at(key.hash(0), 2, 6, 1);
        let h = holdings_at(&r, &key, 6);
        assert_eq!(h.share(2), Tuning::DEFAULT.warm_hit);
        assert_eq!(h.share(1), Tuning::DEFAULT.earlier_hit);
        assert!(h.knows_key());
    }

    #[test]
    fn an_eviction_forgets_the_prompt_there_beyond_its_key() {
        let r = PrefixRecord::with_bytes(1 << 20);
        // A system prompt and a first question (the key), an answer, then the next question.
        let (system, question) = ((b's', 4_000), (b'q', 1_000));
        let turn1 = prompt(&[system, question, (b'a', 8_000)]);
        let turn2 = prompt(&[system, question, (b'a', 8_000), (b'b', 2_000)]);
        r.record(&turn1, 1);
        r.record(&turn1, 2);
        assert!(r.holdings(&turn2).share(1) > 0.8);
        // Peer 1 said it had only a little of turn 1 cached: it keeps the key, no more.
        r.evicted(&turn1, 1, 0.1);
        let h = r.holdings(&turn2);
        assert!(h.knows_key(), "the conversation is still known");
        let key_share = 5_000.0 / f64::from(turn2.bytes());
        assert!((h.share(1) - key_share).abs() < 1e-9, "{}", h.share(1));
        assert!(h.share(2) > 0.8, "another peer's holding is its own");
        // Held further than the key: kept that far, to the whole blocks.
        r.record(&turn1, 1);
        r.evicted(&turn1, 1, 0.6);
        let share = r.holdings(&turn2).share(1);
        let expected = 7.0 * 1024.0 / f64::from(turn2.bytes());
        assert!((share - expected).abs() < 1e-9, "{share}");
        // A key alone is forgotten whole.
        let key = Blocks::of_key(9 << 32);
        r.record(&key, 3);
        r.evicted(&key, 3, 0.0);
        assert!(r.holdings(&key).is_empty());
    }

    #[test]
    fn a_served_block_is_warm_until_it_ages_out_or_is_forgotten() {
        let r = PrefixRecord::with_bytes(1 << 20);
        r.table.record_at(7, 1, 10, 0);
        let at = |now| {
            let (floor, warm) = (r.floor.load(Ordering::Relaxed), WARM_TICKS);
            r.table.find(7).unwrap().fresh(Window { now, floor, warm })
        };
        assert!(named(&at(10 + WARM_TICKS - 1), 1));
        assert!(!named(&at(10 + WARM_TICKS), 1));
        r.forget_at(11);
        assert!(!named(&at(12), 1));
        r.table.record_at(7, 2, 12, 1);
        assert!(named(&at(12), 2) && !named(&at(12), 1));
        // Served in the tick of a forget, before it: forgotten; after it: kept.
        r.table.record_at(7, 3, 13, 2);
        r.forget_at(13);
        assert!(!named(&at(13), 3) && !named(&at(14), 3));
        let r = PrefixRecord::with_bytes(1 << 20);
        r.forget();
        let blocks = Blocks::of_key(7 << 32);
        r.record(&blocks, 4);
        assert!(r.holdings(&blocks).holds(4));
    }
}
