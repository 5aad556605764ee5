//! The seed's cost rule: the latency a request should expect on a peer is
//! `T_wait + (1 − α)·T_prefill + T_decode`, and the cheapest of the key's first peers wins.
//!
//! - `T_wait`: the prefill this process already sent the peer and has no first byte for yet,
//!   plus, when the engine has shown how many requests it runs at once, the requests beyond
//!   that, each waiting its share of a mean stream time (Little's law over the running slots).
//! - `T_prefill`: the prompt's tokens at the configured prefill rate, and `α` the share of the
//!   prompt the peer holds: as deep as the record of prompt blocks saw it served there, or, for
//!   a conversation the record has not seen, all but the newest turn on its primary. A
//!   prefill shares the GPU's steps with the streams running there (chunked prefill), so each
//!   of them waits it out too: it is counted once for this request and once for each of them.
//!   Without that, a spill looks cheap to the request that spills and is paid by the others.
//!   Some of a request to come (the tuning's `arrivals`) is counted besides them: an idle peer's GPU is not free
//!   either, and a prompt prefilled twice holds two GPUs where waiting for the first copy,
//!   already under way, would have answered as soon.
//! - `T_decode`: what the running streams add to this one's steps (a batch shares each step).
//!
//! Everything is in seconds and read from atomics: an estimate, fresh to the last request,
//! with the engine's own figures a scrape old folded into `load` and `capacity`.

use std::time::Duration;

use super::tuning::{LearnedRate, Tuning};

/// Prompt tokens a GPU prefills per second until its answers have shown its own rate: an 8B
/// model on one H100-class GPU.
pub const DEFAULT_PREFILL_TOKENS_PER_SEC: f64 = 10_000.0;

/// Distinct peers of a key's walk priced by default: its primary and the next two.
pub const DEFAULT_CANDIDATES: u32 = 3;

/// The most peers a decision prices.
pub const MAX_CANDIDATES: u32 = 8;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// The prefill rate a peer is priced at until it has shown its own (see
    /// [`crate::routing::prefill`]).
    pub prefill_tokens_per_sec: f64,
    /// Distinct eligible peers of the key's walk priced, the primary first (1 to
    /// [`MAX_CANDIDATES`]).
    pub candidates: u32,
    /// Whether a key this process has not seen is taken as new, and placed where its shared
    /// prefix went or where it costs least (right for the only process in front of its peers,
    /// whose keys spread by hash then no longer); otherwise its primary is priced as holding
    /// it, since another process may have sent it there, and new keys spread by hash.
    pub shared_prefix_placement: Placement,
    /// The cost model's tuned figures (the configuration's `advanced:` section).
    pub tuning: Tuning,
}

impl CostModel {
    pub const DEFAULT: CostModel = CostModel {
        prefill_tokens_per_sec: DEFAULT_PREFILL_TOKENS_PER_SEC,
        candidates: DEFAULT_CANDIDATES,
        shared_prefix_placement: Placement::Auto,
        tuning: Tuning::DEFAULT,
    };
}

impl Default for CostModel {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// When a key the record has not seen is placed as new ([`CostModel::shared_prefix_placement`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// When the record has lately seen the conversation of nearly every later turn
    /// ([`crate::routing::record::Coverage`]): no other process routes what this one does
    /// not hear of.
    Auto,
    Always,
    Never,
}

/// What is believed of one peer when it is priced.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pricing {
    /// Requests on it, this process's and others' (the engine's excess, sibling processes).
    pub load: u32,
    /// Requests it runs at once; 0 while unknown (then nothing is priced as waiting).
    pub capacity: u32,
    /// Tokens this process sent it to prefill that have no first byte yet.
    pub prefill_queue: u64,
    /// How long a request streams there after its first byte, on average.
    pub decode: Option<Duration>,
    /// Prompt tokens it prefills a second, as its answers showed; `None`: not yet known.
    pub rate: Option<f64>,
    /// The share of the prompt it is expected to hold (`α`, 0 to 1).
    pub hit: f64,
}

impl Pricing {
    /// Whether its engine has shown its running slots and every one of them is taken.
    pub fn slots_taken(&self) -> bool {
        self.capacity > 0 && self.load >= self.capacity
    }
}

impl CostModel {
    /// The expected time to first token, plus what decode will add, of a request with
    /// `prompt_tokens` on a peer in state `p`, in seconds.
    pub fn estimate(&self, p: &Pricing, prompt_tokens: u32) -> f64 {
        let alpha = p.hit.clamp(0.0, 1.0);
        let running = f64::from(if p.capacity == 0 {
            p.load
        } else {
            p.load.min(p.capacity)
        });
        let t = &self.tuning;
        let t_prefill =
            (1.0 - alpha) * f64::from(prompt_tokens) / self.rate(p) * (1.0 + t.arrivals + running);
        let t_decode = t.decode_share * running * self.decode(p);
        self.wait(p) + t_prefill + t_decode
    }

    /// `T_wait`: how long a request sent to the peer now waits before its own prefill starts,
    /// in seconds.
    pub fn wait(&self, p: &Pricing) -> f64 {
        // This request is the `load + 1`th: it waits for a slot when that passes the slots.
        let queued = match p.capacity {
            0 => 0,
            slots => (p.load + 1).saturating_sub(slots),
        };
        p.prefill_queue as f64 / self.rate(p)
            + f64::from(queued) * self.decode(p) / f64::from(p.capacity.max(1))
    }

    /// How long a request streams on the peer, in seconds: its own mean once it has one.
    fn decode(&self, p: &Pricing) -> f64 {
        p.decode.unwrap_or(self.tuning.default_decode).as_secs_f64()
    }

    /// The peer's own rate once learned, as far as the tuning lets it in; the configured one
    /// before, in tokens a second.
    pub fn rate(&self, p: &Pricing) -> f64 {
        let configured = self.prefill_tokens_per_sec;
        let rate = match (self.tuning.learn_prefill_rate, p.rate) {
            (LearnedRate::Always, Some(learned)) => learned,
            (LearnedRate::Slower, Some(learned)) => learned.min(configured),
            _ => configured,
        };
        rate.max(1.0)
    }

    /// The tokens a request is expected to make a peer holding `hit` of it prefill.
    pub fn uncached(&self, prompt_tokens: u32, hit: f64) -> u64 {
        (f64::from(prompt_tokens) * (1.0 - hit.clamp(0.0, 1.0))).ceil() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARRIVALS: f64 = Tuning::DEFAULT.arrivals;
    const WARM_HIT: f64 = Tuning::DEFAULT.warm_hit;

    const IDLE: Pricing = Pricing {
        load: 0,
        capacity: 0,
        prefill_queue: 0,
        decode: Some(Duration::from_secs(1)),
        rate: None,
        hit: 0.0,
    };

    fn model() -> CostModel {
        CostModel {
            prefill_tokens_per_sec: 10_000.0,
            ..CostModel::DEFAULT
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn an_idle_cold_peer_costs_its_prefill() {
        let cost = model().estimate(&IDLE, 5_000);
        assert!(close(cost, 0.5 * (1.0 + ARRIVALS)), "{cost}");
    }

    #[test]
    fn a_warm_peer_prefills_only_the_new_turn() {
        let warm = Pricing {
            hit: WARM_HIT,
            ..IDLE
        };
        let cost = model().estimate(&warm, 5_000);
        assert!(close(cost, 0.05 * (1.0 + ARRIVALS)), "{cost}");
        assert_eq!(model().uncached(5_000, WARM_HIT), 500);
        assert_eq!(model().uncached(5_000, Tuning::DEFAULT.earlier_hit), 2_500);
        assert_eq!(model().uncached(5_000, 0.0), 5_000);
    }

    #[test]
    fn a_prefill_is_paid_by_every_stream_running_beside_it() {
        let busy = Pricing { load: 3, ..IDLE };
        // 0.5 s for this request, for each of the three streams and for those to come, plus
        // the streams' decode share.
        let cost = model().estimate(&busy, 5_000);
        assert!(close(cost, 0.5 * (4.0 + ARRIVALS) + 0.02 * 3.0), "{cost}");
        // A warm peer with streams still beats a cold idle one.
        let warm = Pricing {
            hit: WARM_HIT,
            ..busy
        };
        assert!(model().estimate(&warm, 5_000) < model().estimate(&IDLE, 5_000));
    }

    #[test]
    fn queued_prefill_is_waited_for() {
        let busy = Pricing {
            hit: WARM_HIT,
            prefill_queue: 20_000,
            ..IDLE
        };
        // 2 s of prefill ahead outweighs a cold 0.5 s prefill on an idle peer.
        assert!(model().estimate(&busy, 5_000) > model().estimate(&IDLE, 5_000));
        let light = Pricing {
            prefill_queue: 2_000,
            ..busy
        };
        assert!(model().estimate(&light, 5_000) < model().estimate(&IDLE, 5_000));
    }

    #[test]
    fn waiting_for_a_queued_prefill_of_the_prompt_beats_repeating_it() {
        // The same prompt's prefill is under way there: this one starts when it ends, as soon
        // as a copy on an idle peer would have. The copy takes the idle GPU from what comes.
        let behind = Pricing {
            load: 1,
            prefill_queue: 5_000,
            hit: 0.99,
            ..IDLE
        };
        assert!(model().estimate(&behind, 5_000) < model().estimate(&IDLE, 5_000));
        // Not when the wait is much longer than the copy.
        let far_behind = Pricing {
            prefill_queue: 8_000,
            ..behind
        };
        assert!(model().estimate(&far_behind, 5_000) > model().estimate(&IDLE, 5_000));
    }

    #[test]
    fn beyond_capacity_a_request_waits_a_share_of_the_stream_time() {
        let full = Pricing {
            load: 8,
            capacity: 8,
            hit: WARM_HIT,
            ..IDLE
        };
        // One ahead of its slot: it waits 1 s / 8 slots.
        assert!(close(model().wait(&full), 0.125));
        let expected = 0.125 + 0.05 * (9.0 + ARRIVALS) + 0.02 * 8.0;
        assert!(close(model().estimate(&full, 5_000), expected));
        let with_room = Pricing { load: 6, ..full };
        assert!(close(model().wait(&with_room), 0.0));
        assert!(model().estimate(&with_room, 5_000) < model().estimate(&full, 5_000));
    }

    #[test]
    fn a_learned_rate_replaces_the_configured_one_as_far_as_asked() {
        let price = |learn, rate| {
            let mut m = model();
            m.tuning.learn_prefill_rate = learn;
            let p = Pricing {
                rate: Some(rate),
                ..IDLE
            };
            m.estimate(&p, 5_000) / (1.0 + ARRIVALS)
        };
        // Configured: 10,000 tokens/s, so 5,000 tokens take 0.5 s.
        for (learn, slow, fast) in [
            (LearnedRate::Never, 0.5, 0.5),
            (LearnedRate::Slower, 2.0, 0.5),
            (LearnedRate::Always, 2.0, 0.25),
        ] {
            let (s, f) = (price(learn, 2_500.0), price(learn, 20_000.0));
            assert!(close(s, slow) && close(f, fast), "{learn:?}: {s} {f}");
        }
    }

    #[test]
    fn unknown_capacity_prices_no_wait() {
        let loaded = Pricing { load: 30, ..IDLE };
        assert!(close(model().wait(&loaded), 0.0));
        let cost = model().estimate(&loaded, 0);
        assert!(close(cost, 0.02 * 30.0), "{cost}");
    }
}
