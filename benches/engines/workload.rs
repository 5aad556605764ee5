//! The seeded multi-turn workload: sessions on a few shared system prompts, each arriving at
//! its own time and thinking between turns.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};

pub const SESSIONS: usize = 16;
pub const TURNS: usize = 4;
/// System prompts the sessions share.
pub const PROMPTS: usize = 3;
/// Words of a system prompt: about 1,500 tokens with the engines' Llama vocabulary.
const PROMPT_WORDS: usize = 1_150;
/// Tokens each answer is cut at: prefill, which the routing decides, dominates.
pub const MAX_TOKENS: u32 = 16;

const WORDS: [&str; 40] = [
    "order", "invoice", "customer", "refund", "delivery", "warranty", "account", "payment",
    "shipping", "address", "return", "label", "parcel", "store", "manager", "policy", "receipt",
    "discount", "product", "service", "repair", "battery", "screen", "cable", "charger", "laptop",
    "phone", "printer", "network", "router", "monday", "friday", "morning", "evening", "quickly",
    "politely", "always", "never", "within", "days",
];

#[derive(Clone)]
pub struct Session {
    /// From the pass's start.
    pub arrival: Duration,
    pub system: usize,
    pub turns: Vec<String>,
    /// Before each turn after the first.
    pub think: Vec<Duration>,
}

pub struct Workload {
    pub prompts: Vec<String>,
    pub sessions: Vec<Session>,
}

fn words(rng: &mut StdRng, n: usize) -> String {
    (0..n)
        .map(|_| *WORDS.choose(rng).unwrap())
        .collect::<Vec<_>>()
        .join(" ")
}

impl Workload {
    pub fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let prompts = (0..PROMPTS)
            .map(|p| {
                format!(
                    "You are assistant number {p} of a hardware shop. Rules: {}",
                    words(&mut rng, PROMPT_WORDS)
                )
            })
            .collect();
        let mut arrival = Duration::ZERO;
        let sessions = (0..SESSIONS)
            .map(|_| {
                // About one new session every three seconds, so that early sessions are
                // mid-conversation when later ones arrive, and the two single-threaded engines
                // are busy but not saturated (at one every 1.5 s, TTFT was mostly queueing).
                arrival += Duration::from_millis(rng.random_range(1_500..4_500));
                Session {
                    arrival,
                    system: rng.random_range(0..PROMPTS),
                    turns: (0..TURNS)
                        .map(|_| {
                            let n = rng.random_range(40..120);
                            format!("Question: {}?", words(&mut rng, n))
                        })
                        .collect(),
                    think: (1..TURNS)
                        .map(|_| Duration::from_millis(rng.random_range(2_000..5_000)))
                        .collect(),
                }
            })
            .collect();
        Self { prompts, sessions }
    }
}
