//! Every tuned figure of the cost model, in one value: what each means and where its value
//! came from. The defaults are the figures the cluster bench chose; the configuration's
//! `advanced:` section overrides any of them, so a benchmark can sweep them without a rebuild.
//!
//! Figures that an engine or a measurement fixes (the prefill rate, the running slots, the
//! stream time) are not here: they are learned per peer or configured as operator decisions.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tuning {
    /// The share of a prompt a peer is expected to hold when it served the key last (a
    /// conversation resends its history: all but the newest turn). Origin: a conversation of
    /// `n` turns holds `(n-1)/n` of itself; 0.9 is ten turns, read off the bench's chat shapes
    /// (8bd91a0: chats 65.9% -> 69.7% hits).
    pub warm_hit: f64,
    /// The share a peer that served the key earlier, not last, is expected to hold: the shared
    /// part and the turns up to then. Origin: half, chosen with `warm_hit` (8bd91a0).
    pub earlier_hit: f64,
    /// How much each other running stream slows a decode step. Origin: vLLM on one GPU, about
    /// 2% per running sequence at small batches (vLLM's own benchmark figures).
    pub decode_share: f64,
    /// The requests to come that a prefill is expected to delay besides the running ones: a
    /// prefill holds its GPU, and what arrives meanwhile waits it out. Origin: cluster bench
    /// `long` (efb3357: p99 1166-987 ms against 1338-1586 ms with a tenth or none); 0.1 and 0.5
    /// stay within repeated runs' noise on the tuning seeds (`docs/benchmarks.md`, 2026-12-04).
    pub arrivals: f64,
    /// The stream time assumed of a peer before it has finished a request. Origin: a short chat
    /// answer (~100 tokens at ~200 tokens/s); replaced by the peer's own mean at its first stream.
    pub default_decode: Duration,
    /// How much cheaper than the primary another peer must be to take a request from it: less
    /// is the noise of learned times and tiny prompts. Origin: the cluster bench (6001b53).
    pub spill_margin: Duration,
    /// The share of a conversation's home's cost another peer must also undercut it by: a
    /// move trades decode time and home's other streams for the mover's own first token. And
    /// the share of the prefill a request would make another peer do, beyond the peer holding
    /// most of its prompt (`prefix_home_share`), that the other must undercut that peer by: a
    /// copy holds the GPU it lands on. Origin: the cluster bench's `chats` and `hot` shapes;
    /// 0.1 and 0.5 stay within repeated runs' noise on the tuning seeds (2026-12-04); as the
    /// copy's hurdle, with home's floor at unknown slots, the tuning seeds alternately twice:
    /// hits +0.48 and +0.53 points, TTFT p99 0.94x and 0.95x (`docs/benchmarks.md`).
    pub spill_share: f64,
    /// Whether a request may go where it must prefill more of its prompt than at home only onto
    /// a peer with a running slot free (when its engine has shown its slots): a second copy of
    /// a prefix on a saturated engine adds work to a cluster with none to spare, and buys no
    /// throughput. Home may still refuse it at its bound. Origin: on two saturated vLLM engines
    /// (three seeds) TTFT p50 0.80x, p99 0.73x, 0.8 points more hits; on two llama.cpp engines
    /// (three other seeds) and over the cluster bench's tuning seeds within the noise, but for
    /// its `histories` shape on the `engine` model, 3-5 points fewer hits (caches under
    /// pressure evict more where copies stay home); `docs/real-engines.md`,
    /// `docs/benchmarks.md`, 2026-12-05.
    pub copies_need_room: bool,
    /// The turns a new conversation is expected to send after this one, each paying again for
    /// a placement away from its shared prefix. Origin: the bench's conversations (4 turns).
    pub future_turns: f64,
    /// What `least_cost` never bounds a peer below while its engine's running slots are unknown:
    /// fewer than any real engine runs at once (vLLM and SGLang run hundreds). Origin: the
    /// smallest batch any engine in the docs runs (llama.cpp's `-np 4`).
    pub unknown_capacity_floor: u32,
    /// The least a conversation's own home is bounded at, above its engine's slots where they
    /// are fewer: a turn sent on prefills its history again; and its slots while its engine
    /// has not shown them (home then queues `conversation_queue` of them beyond: held at the
    /// floor, an engine with as many slots never queues, and never shows them). Origin: the
    /// cluster bench (8 running slots); above the slots, the llama.cpp engines bench (one and
    /// two slots).
    pub conversation_floor: u32,
    /// The share of its engine's running slots a conversation's own home may queue beyond
    /// them: home's floor is its slots and this share more, or `conversation_floor` where that
    /// is higher. Past its slots a turn waits at home for one, which the cost rule prices;
    /// sent on, it prefills its history again and, where caches are full, evicts another's.
    /// Origin: the cluster bench's `histories` shape (8-slot GPUs), tuning seeds: 73.0% ->
    /// 77.5% hits on the lane model and 63.4% -> 66.1% on the engine model at 0.5; 1.0 gave
    /// the same hits with a p99 up to 1.8x on the engine model, 3.0 fewer hits
    /// (`docs/benchmarks.md`, 2026-12-06).
    pub conversation_queue: f64,
    /// The share of a prompt a peer must hold more than (and as much of it as any other) for
    /// its bound to be floored as a conversation's own home is (its slots and
    /// `conversation_queue` more, at least `conversation_floor`): elsewhere the request would
    /// prefill that share again, a new conversation a long shared document, a later turn a
    /// history two peers hold. 1: only a conversation's own home. Origin: the cluster bench's
    /// tuning seeds, 1 and 0.5 alternately twice: hits +0.58 and +0.26 points, TTFT p99 0.88x
    /// and 0.98x, gained on `long` and `prompts` each time; on two llama.cpp engines within
    /// the noise, fewer turns moved (`docs/benchmarks.md`, 2026-12-06).
    pub prefix_home_share: f64,
    /// Characters of text per token when the prompt's tokens are estimated from its bytes.
    /// Origin: OpenAI's rule of thumb for English text.
    pub chars_per_token: u32,
    /// How long a peer is believed to keep a block after it last served it; the prompt record
    /// counts it in its ticks of 100 ms. Origin: what a busy GPU's cache keeps of a prefix that
    /// stopped coming, roughly; the engine evicts by recency under memory pressure, which the
    /// balancer cannot see.
    pub warm_for: Duration,
    /// Which prefill rate a peer is priced at once its first bytes have shown one (see
    /// [`crate::routing::prefill`]); the rate is learned and exported either way. Origin:
    /// `Slower`, because on two llama.cpp engines (six seeds) it moved 35% fewer turns away
    /// from their conversation's engine at the same TTFT, and on the cluster bench's tuning
    /// seeds, whose engines are faster than configured, it moved nothing beyond the noise
    /// (`docs/benchmarks.md`, "Learned from the answers").
    pub learn_prefill_rate: LearnedRate,
    /// How much less of a prompt than the record predicted (a share of the prompt) an engine
    /// may report cached before the record is taken as wrong there and forgets the
    /// conversation on that peer; 1: never (the default). Engines cache whole blocks of 16 to
    /// 256 tokens, so a few points are rounding, and 0.25 is a margin above that. Origin: off,
    /// because at 0.25 the cluster bench's tuning seeds moved by noise only (hits -0.3 points,
    /// TTFT p99 -3%, same bench section).
    pub eviction_margin: f64,
}

impl Tuning {
    pub const DEFAULT: Tuning = Tuning {
        warm_hit: 0.9,
        earlier_hit: 0.5,
        decode_share: 0.02,
        arrivals: 0.25,
        default_decode: Duration::from_millis(500),
        spill_margin: Duration::from_millis(5),
        spill_share: 0.25,
        copies_need_room: true,
        future_turns: 3.0,
        unknown_capacity_floor: 4,
        conversation_floor: 8,
        conversation_queue: 0.5,
        prefix_home_share: 0.5,
        chars_per_token: 4,
        warm_for: Duration::from_secs(60),
        learn_prefill_rate: LearnedRate::Slower,
        eviction_margin: 1.0,
    };
}

impl Default for Tuning {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Whether a peer's learned prefill rate replaces the configured one in its price.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LearnedRate {
    /// The configured rate always.
    Never,
    /// The learned rate where it is slower than the configured one: an engine that prefills
    /// slower than the operator said makes a move dearer, never cheaper than the figures of
    /// the rule were fitted to.
    Slower,
    /// The learned rate, faster or slower. On the cluster bench's tuning seeds pricing the
    /// simulator's true rate (six times the configured one) cost 2.3 points of hits and 10% of
    /// TTFT p50: the rule moved conversations for load that it keeps home at a dearer prefill.
    Always,
}
