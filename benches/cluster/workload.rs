//! The seeded workloads: sessions with their arrival, system prompt and turns.

use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shape {
    Hot,
    Chats,
    Long,
    Prompts,
    Histories,
}

pub const SHAPES: [Shape; 5] = [
    Shape::Hot,
    Shape::Chats,
    Shape::Long,
    Shape::Prompts,
    Shape::Histories,
];

impl Shape {
    pub fn name(self) -> &'static str {
        match self {
            Shape::Hot => "hot",
            Shape::Chats => "chats",
            Shape::Long => "long",
            Shape::Prompts => "prompts",
            Shape::Histories => "histories",
        }
    }

    pub fn gpus(self) -> usize {
        match self {
            Shape::Prompts => 6,
            _ => 4,
        }
    }
}

pub struct Turn {
    pub user: String,
    pub think: Duration,
    pub max_tokens: usize,
}

pub struct Session {
    pub start: Duration,
    /// Chat messages, or one growing completions prompt.
    pub chat: bool,
    pub system: Arc<str>,
    pub turns: Vec<Turn>,
}

pub const WORDS: &[&str] = &[
    "patient", "history", "dose", "allergy", "symptom", "protocol", "triage", "follow", "review",
    "chart", "note", "fever", "pain", "scan", "result", "referral", "plan", "check", "urgent",
    "routine", "clinic", "ward", "nurse", "report", "consent", "record", "summary", "advice",
];

/// Random words, `range` characters long (give or take a word).
pub fn words(rng: &mut StdRng, range: std::ops::Range<usize>) -> String {
    let chars = rng.random_range(range);
    let mut s = String::with_capacity(chars + 16);
    while s.len() < chars {
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        s.push(' ');
    }
    s
}

/// Exponential, with this mean.
pub fn think(rng: &mut StdRng, mean_secs: f64) -> Duration {
    Duration::from_secs_f64(-(1.0 - rng.random::<f64>()).ln() * mean_secs)
}

/// Turns of `chars` characters each, `think_secs` apart on average.
pub fn turns(
    rng: &mut StdRng,
    count: std::ops::Range<usize>,
    chars: std::ops::Range<usize>,
    think_secs: f64,
) -> Vec<Turn> {
    (0..rng.random_range(count))
        .map(|_| Turn {
            user: words(rng, chars.clone()),
            think: think(rng, think_secs),
            max_tokens: rng.random_range(24..72),
        })
        .collect()
}

/// The system prompts of `n` departments, each `chars` long.
pub fn departments(rng: &mut StdRng, n: usize, chars: std::ops::Range<usize>) -> Vec<Arc<str>> {
    (0..n)
        .map(|d| {
            let protocol = words(rng, chars.clone());
            format!("You are the assistant of department {d}. Protocol: {protocol}").into()
        })
        .collect()
}

/// A session's department of `n`: the first with probability `hot`, else any other.
pub fn department(rng: &mut StdRng, n: usize, hot: f64) -> usize {
    if rng.random_bool(hot) {
        0
    } else {
        rng.random_range(1..n)
    }
}

pub fn workload(shape: Shape, seed: u64) -> Vec<Session> {
    let mut rng = StdRng::seed_from_u64(seed ^ shape as u64);
    match shape {
        Shape::Hot => {
            let prompts = departments(&mut rng, 6, 2500..5000);
            (0..120)
                .map(|i| {
                    let dept = department(&mut rng, 6, 0.5);
                    let start = if i % 3 == 0 {
                        Duration::from_millis(rng.random_range(0..1500))
                    } else {
                        Duration::from_millis(rng.random_range(0..15_000))
                    };
                    Session {
                        start,
                        chat: dept != 0,
                        system: Arc::clone(&prompts[dept]),
                        turns: turns(&mut rng, 4..9, 600..2400, 1.2),
                    }
                })
                .collect()
        }
        Shape::Chats => (0..160)
            .map(|i| Session {
                start: Duration::from_millis(rng.random_range(0..20_000)),
                chat: true,
                system: format!("You are assistant {i}. {}", words(&mut rng, 400..1600)).into(),
                turns: turns(&mut rng, 3..9, 200..1200, 1.2),
            })
            .collect(),
        Shape::Long => {
            let docs: Vec<Arc<str>> = [20_000, 36_000, 52_000, 62_000]
                .iter()
                .enumerate()
                .map(|(d, &len)| {
                    format!(
                        "Answer from document {d}: {}",
                        words(&mut rng, len..len + 1)
                    )
                    .into()
                })
                .collect();
            (0..60)
                .map(|i| Session {
                    start: Duration::from_millis(
                        (i / 20) as u64 * 6_000 + rng.random_range(0..500),
                    ),
                    chat: true,
                    system: Arc::clone(&docs[rng.random_range(0..docs.len())]),
                    turns: turns(&mut rng, 2..5, 200..800, 1.2),
                })
                .collect()
        }
        Shape::Prompts => {
            let prompts = departments(&mut rng, 3, 24_000..24_001);
            (0..80)
                .map(|i| {
                    let dept = department(&mut rng, 3, 0.7);
                    let start = if i < 30 {
                        Duration::from_millis(rng.random_range(0..1000))
                    } else {
                        Duration::from_millis(rng.random_range(1000..20_000))
                    };
                    Session {
                        start,
                        chat: false,
                        system: Arc::clone(&prompts[dept]),
                        turns: turns(&mut rng, 5..6, 300..1500, 1.2),
                    }
                })
                .collect()
        }
        // Sessions whose histories outgrow the caches: 64 chats of 6 to 9 turns, each with
        // its own 3-4 KB system prompt and 1.5-2.5 KB a question, all under way within eight
        // seconds, thinking 2 s between turns (longer than the other shapes' 1.2 s, so the
        // GPUs are busy but not saturated). Each ends near 22 KB (5,500 tokens at 4
        // characters a token, 6,700 at 3.3): eight running still fit one GPU's 65,536-token
        // pool, but together the histories reach 1.3 times the four GPUs' caches, so a
        // router that copies a history onto a second GPU evicts another's, and evictions
        // decide the hits.
        Shape::Histories => (0..64)
            .map(|i| Session {
                start: Duration::from_millis(rng.random_range(0..8_000)),
                chat: true,
                system: format!("You are assistant {i}. {}", words(&mut rng, 3000..4000)).into(),
                turns: turns(&mut rng, 6..10, 1500..2500, 2.0),
            })
            .collect(),
    }
}
