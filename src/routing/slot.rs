//! The RAII [`Slot`] that counts one request on a peer, from the choice to the end of its
//! answer, and what the answer teaches of the peer on the way: when its prefill ended (the
//! first byte), how long it streamed, and what the engine said it had cached.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use super::peer::Peer;
use super::prefill::{MIN_SAMPLE, MIN_SAMPLE_TOKENS};

/// How much less of a prompt than the record predicted an engine must report cached for the
/// answer to count as a miss of the record's: engines cache whole blocks of 16 to 256 tokens,
/// so a few points are rounding, a quarter of the prompt is not.
pub const MISSED: f64 = 0.25;
use super::usage::Usage;

impl Peer {
    /// Takes a slot if the peer carries fewer than `bound` requests, its external load
    /// included, and is not wedged. The check and the increment are one compare-and-swap, so concurrent takers can
    /// never push the count past `bound`.
    pub fn try_take(self: &Arc<Self>, bound: u32) -> Option<Slot> {
        if self.wedged() {
            return None;
        }
        let room = bound.saturating_sub(self.external());
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < room).then_some(n + 1)
            })
            .ok()?;
        self.cluster.took();
        Some(Slot::new(self))
    }

    /// Takes a slot with no ceiling (pure sticky hashing).
    pub fn take(self: &Arc<Self>) -> Slot {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.cluster.took();
        Slot::new(self)
    }
}

/// One in-flight request on one peer. Dropping it releases the slot, exactly once, and with
/// it whatever prefill it still had counted.
#[derive(Debug)]
pub struct Slot {
    peer: Arc<Peer>,
    /// Tokens this request adds to the peer's prefill queue until its first byte.
    prefill: u64,
    /// What the choice expected of a request that carries a prompt: only those time the peer
    /// (a model list answered at once would pull its means down).
    priced: Option<Priced>,
    /// When the first byte of the answer came.
    since: Option<Instant>,
    usage: Option<Usage>,
}

#[derive(Debug, Clone, Copy)]
struct Priced {
    prompt_tokens: u32,
    /// The share of the prompt the record said the peer held.
    hit: f32,
    /// Tokens of this process's prefill queued on the peer ahead of this request.
    ahead: u64,
    /// Whether the request had to wait for one of the engine's running slots: its first
    /// byte then says little of the prefill rate.
    queued: bool,
    /// When the slot was priced, in the step that took it: the first byte is timed from then.
    /// Read here, not when the slot is made, since only a priced slot is timed: the others
    /// (every slot of the policies that price nothing) save a clock read a decision.
    taken: Instant,
}

impl Slot {
    fn new(peer: &Arc<Peer>) -> Self {
        Self {
            peer: Arc::clone(peer),
            prefill: 0,
            priced: None,
            since: None,
            usage: None,
        }
    }

    pub fn peer(&self) -> &Arc<Peer> {
        &self.peer
    }

    /// Whether the request carries a prompt the choice priced.
    pub fn priced(&self) -> bool {
        self.priced.is_some()
    }

    /// When the choice priced it, if it did.
    pub fn priced_at(&self) -> Option<Instant> {
        self.priced.map(|p| p.taken)
    }

    /// Counts the `tokens` of a `prompt_tokens` prompt that the peer, holding `hit` of it as
    /// far as the record knows, must prefill for this request, until [`Slot::prefilled`] or
    /// the end.
    pub fn expect_prefill(&mut self, prompt_tokens: u32, hit: f64, tokens: u64) {
        // Adding nothing (a prompt held whole, a key alone) needs no locked add.
        let queue = &self.peer.prefill_queue;
        let ahead = match tokens {
            0 => queue.load(Ordering::Relaxed),
            _ => queue.fetch_add(tokens, Ordering::Relaxed),
        };
        let capacity = self.peer.capacity();
        self.prefill += tokens;
        self.priced = Some(Priced {
            prompt_tokens,
            hit: hit as f32,
            ahead,
            queued: capacity > 0 && self.peer.load() > capacity,
            taken: Instant::now(),
        });
    }

    /// The first byte of the answer came: the prompt is prefilled, and the answer streams
    /// until the slot is dropped.
    pub fn prefilled(&mut self) {
        self.release_prefill();
        if self.priced.is_some() {
            self.since.get_or_insert_with(Instant::now);
        }
    }

    /// What the engine said of the prompt in its answer: counted against the record's
    /// prediction for the peer (a miss when it held [`MISSED`] of the prompt less). Returns
    /// the share of the prompt the engine held when that is less than the record predicted by
    /// more than `margin` (the tuning's `eviction_margin`): the record should forget it there.
    pub fn report(&mut self, usage: Usage, margin: f64) -> Option<f64> {
        let priced = self.priced?;
        self.usage = Some(usage);
        let held = usage.cached_share();
        let short = f64::from(priced.hit) - held;
        self.peer
            .engine
            .record_usage(usage, f64::from(priced.hit), short > MISSED);
        (short > margin).then_some(held)
    }

    fn release_prefill(&mut self) {
        let tokens = std::mem::take(&mut self.prefill);
        if tokens > 0 {
            self.peer.prefill_queue.fetch_sub(tokens, Ordering::Relaxed);
        }
    }

    /// Teaches the peer's engine what this request showed of it.
    fn learn(&self, priced: &Priced, since: Instant) {
        let engine = &self.peer.engine;
        engine.record_decode(since.elapsed());
        let ttfb = since - priced.taken;
        if priced.queued || ttfb < MIN_SAMPLE {
            return;
        }
        // The engine's own count of what it had to prefill, in this process's tokens; the
        // record's guess when it said nothing.
        let prompt = f64::from(priced.prompt_tokens);
        let own = match self.usage {
            Some(u) => prompt * (1.0 - u.cached_share()),
            None => prompt * (1.0 - f64::from(priced.hit)),
        };
        let tokens = priced.ahead as f64 + own;
        if tokens < MIN_SAMPLE_TOKENS {
            return;
        }
        if let Some(rate) = engine.record_prefill(tokens, ttfb) {
            self.peer.cluster.learned_rate(rate);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.release_prefill();
        if let (Some(priced), Some(since)) = (self.priced, self.since) {
            self.learn(&priced, since);
        }
        self.peer.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.peer.cluster.released();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;
    use std::time::Duration;

    use super::*;
    use crate::routing::spec::PeerSpec;

    fn peer(max: u32) -> Arc<Peer> {
        let spec = PeerSpec::new("127.0.0.1:1".parse().unwrap()).max_in_flight(max);
        Arc::new(Peer::new(&spec, Arc::default()))
    }

    #[test]
    fn take_stops_at_bound_and_drop_releases_once() {
        let p = peer(2);
        let a = p.try_take(2).unwrap();
        let b = p.try_take(2).unwrap();
        assert!(p.try_take(2).is_none());
        assert_eq!(p.cluster.in_flight(), 2);
        drop(a);
        assert_eq!(p.in_flight(), 1);
        let c = p.try_take(2).unwrap();
        drop((b, c));
        assert_eq!(p.in_flight(), 0);
        assert_eq!(p.cluster.in_flight(), 0);
    }

    #[test]
    fn only_prompts_time_the_decode() {
        let p = peer(4);
        let mut light = p.take();
        light.prefilled();
        drop(light);
        assert_eq!(p.decode_time(), None, "a model list timed the decode");
        let mut prompt = p.take();
        prompt.expect_prefill(100, 0.0, 100);
        assert_eq!(p.prefill_queue(), 100);
        prompt.prefilled();
        assert_eq!(p.prefill_queue(), 0);
        drop(prompt);
        assert!(p.decode_time().is_some());
    }

    #[test]
    fn external_load_counts_against_every_ceiling() {
        let p = peer(3);
        p.set_external(2);
        assert_eq!(p.cluster.external(), 2);
        let a = p.try_take(3).unwrap();
        assert!(
            p.try_take(3).is_none(),
            "2 elsewhere + 1 here = the ceiling"
        );
        assert_eq!(p.load(), 3);
        p.set_external(0);
        assert_eq!(p.cluster.external(), 0);
        let b = p.try_take(3).unwrap();
        drop((a, b));
        p.set_external(7);
        assert!(p.try_take(3).is_none(), "more elsewhere than the ceiling");
    }

    #[test]
    fn a_report_far_below_the_prediction_is_a_miss() {
        let p = peer(4);
        let mut warm = p.take();
        warm.expect_prefill(1_000, 0.9, 100);
        let usage = |cached| Usage {
            prompt_tokens: 1_000,
            cached_tokens: cached,
        };
        assert_eq!(warm.report(usage(850), 0.25), None, "a block's rounding");
        assert_eq!(warm.report(usage(100), 0.25), Some(0.1));
        let mut cold = p.take();
        cold.expect_prefill(1_000, 0.0, 1_000);
        assert_eq!(cold.report(usage(0), 0.25), None);
        let mut unpriced = p.take();
        assert_eq!(
            unpriced.report(usage(0), 0.25),
            None,
            "nothing was predicted"
        );
        let r = p.engine.cache_report();
        assert_eq!(
            (r.prompt_tokens, r.predicted_cached, r.reported_cached),
            (3_000, 1_800, 950)
        );
        assert_eq!(r.misses, 1);
        // A miss is counted whatever the margin; the record is told only past the margin.
        let mut warm = p.take();
        warm.expect_prefill(1_000, 0.9, 100);
        assert_eq!(warm.report(usage(100), 1.0), None);
        assert_eq!(p.engine.cache_report().misses, 2);
    }

    #[test]
    fn the_prefill_rate_is_learned_from_first_bytes() {
        let p = peer(64);
        assert_eq!(p.engine.prefill_rate(), None);
        // Requests of 1,000 to 4,000 uncached tokens, each answered after 5 ms plus its
        // tokens at 20,000 a second (slots made to look taken that long ago).
        for i in 0..12u32 {
            let tokens = 1_000 + (i % 4) * 1_000;
            let mut slot = p.take();
            slot.expect_prefill(tokens, 0.0, u64::from(tokens));
            let ttfb = Duration::from_secs_f64(0.005 + f64::from(tokens) / 20_000.0);
            if let Some(priced) = &mut slot.priced {
                priced.taken = Instant::now() - ttfb;
            }
            slot.prefilled();
        }
        let rate = p.engine.prefill_rate().unwrap();
        assert!((rate / 20_000.0 - 1.0).abs() < 0.05, "{rate}");
    }

    #[test]
    fn prompts_too_short_to_show_a_prefill_teach_no_rate() {
        let p = peer(64);
        // 20 ms for 40 tokens would be a rate of 2,000 a second: the engine's fixed cost.
        for _ in 0..12 {
            let mut slot = p.take();
            slot.expect_prefill(40, 0.0, 40);
            if let Some(priced) = &mut slot.priced {
                priced.taken = Instant::now() - Duration::from_millis(20);
            }
            slot.prefilled();
        }
        assert_eq!(p.engine.prefill_rate(), None);
    }

    #[test]
    fn bound_holds_under_eight_threads() {
        let p = peer(5);
        let peak = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (p, peak) = (Arc::clone(&p), Arc::clone(&peak));
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..20_000u32 {
                        if let Some(s) = p.try_take(5) {
                            peak.fetch_max(p.in_flight(), Ordering::Relaxed);
                            held.push(s);
                        }
                        if i % 3 == 0 {
                            held.pop();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(peak.load(Ordering::Relaxed) <= 5);
        assert!(peak.load(Ordering::Relaxed) >= 1);
        assert_eq!(p.in_flight(), 0);
        assert_eq!(p.cluster.in_flight(), 0);
    }
}
