//! The numbers of each pass, the table (medians over the seeds, min-max beside) and the JSON.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;

use crate::common::{out_dir, percentile};
use crate::run::{Counters, Pass, Turn};
use crate::workload::TURNS;

/// What one pass comes to.
pub struct Stats {
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub e2e_p50_ms: f64,
    pub wall_s: f64,
    pub errors: f64,
    pub prompt_tokens: f64,
    /// The final chunks' `timings.cache_n`, summed.
    pub cached_tokens: f64,
    /// The engines' own `prompt_tokens_cached_total`, summed.
    pub engine_cached_total: f64,
    /// Each engine's own counters over the pass.
    pub engines: Vec<Counters>,
    /// Later turns that left their session's engine (prefixlb's rows only).
    pub moved: Option<f64>,
    /// From the engines' own reports, for every router: first turns whose engine held less
    /// than half of the prompt (their system prompt was cold there)...
    pub cold_opens: f64,
    /// ...and later turns whose engine held less than the turn before had sent, by more than
    /// two of vLLM's 128-token blocks (their history was prefilled again).
    pub lost_histories: f64,
    /// Every turn: session, its system prompt, turn, prompt and cached tokens, TTFT, and the
    /// engine when the router names it.
    turns: Vec<serde_json::Value>,
    learned: Vec<String>,
}

fn turn_details(pass: &Pass) -> Vec<serde_json::Value> {
    let sessions = pass.turns.chunks(TURNS).enumerate();
    sessions
        .flat_map(|(s, turns)| {
            turns.iter().enumerate().map(move |(t, turn)| {
                json!({
                    "session": s,
                    "system": pass.systems.get(s),
                    "turn": t,
                    "prompt": turn.as_ref().map(|t| t.prompt),
                    "cached": turn.as_ref().map(|t| t.cached),
                    "ttft_ms": turn.as_ref().map(|t| t.ttft.as_millis() as u64),
                    "peer": pass.peers.get(&(s, t)),
                })
            })
        })
        .collect()
}

/// Counts the turns of `turns` (session by session, [`TURNS`] each) that found their prompt
/// cold where they landed: (first turns, later turns).
fn cold_turns(turns: &[Option<Turn>]) -> (f64, f64) {
    let (mut opens, mut lost) = (0.0, 0.0);
    for session in turns.chunks(TURNS) {
        if let Some(Some(first)) = session.first() {
            opens += f64::from(u8::from(first.cached * 2 < first.prompt));
        }
        for pair in session.windows(2) {
            if let [Some(before), Some(turn)] = pair {
                lost += f64::from(u8::from(turn.cached + 256 < before.prompt));
            }
        }
    }
    (opens, lost)
}

impl Stats {
    fn of(pass: &Pass) -> Self {
        let ok: Vec<_> = pass.turns.iter().flatten().collect();
        let sorted = |f: &dyn Fn(&crate::run::Turn) -> Duration| {
            let mut v: Vec<f64> = ok.iter().map(|t| f(t).as_secs_f64() * 1e3).collect();
            v.sort_by(f64::total_cmp);
            v
        };
        let ttft = sorted(&|t| t.ttft);
        let (cold_opens, lost_histories) = cold_turns(&pass.turns);
        Self {
            ttft_p50_ms: percentile(&ttft, 50.0),
            ttft_p99_ms: percentile(&ttft, 99.0),
            e2e_p50_ms: percentile(&sorted(&|t| t.e2e), 50.0),
            wall_s: pass.wall.as_secs_f64(),
            errors: (pass.turns.len() - ok.len()) as f64,
            prompt_tokens: ok.iter().map(|t| t.prompt as f64).sum(),
            cached_tokens: ok.iter().map(|t| t.cached as f64).sum(),
            engine_cached_total: pass.engines.iter().map(|e| e.cached).sum(),
            engines: pass.engines.clone(),
            moved: pass.moved().map(|m| m as f64),
            cold_opens,
            lost_histories,
            turns: turn_details(pass),
            learned: pass.learned.clone(),
        }
    }

    pub fn hit_ratio(&self) -> f64 {
        self.cached_tokens / self.prompt_tokens.max(1.0)
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "e2e_p50_ms": self.e2e_p50_ms,
            "wall_s": self.wall_s,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_ratio": self.hit_ratio(),
            "engine_cached_total": self.engine_cached_total,
            "engines": self.engines.iter().map(Counters::json).collect::<Vec<_>>(),
            "moved_turns": self.moved,
            "cold_opens": self.cold_opens,
            "lost_histories": self.lost_histories,
            "turns": self.turns,
            "prefixlb_learned_rates": self.learned,
        })
    }
}

/// One line of progress for a pass.
pub fn line(name: &str, seed: u64, pass: &Pass) -> String {
    let s = Stats::of(pass);
    let moved = s
        .moved
        .map(|m| format!(", {m} turns moved"))
        .unwrap_or_default();
    format!(
        "{name} seed {seed}: TTFT p50 {:.0} ms p99 {:.0} ms, {:.1} s, {} errors, {:.1}% cached, {} cold opens, {} lost histories{moved}",
        s.ttft_p50_ms,
        s.ttft_p99_ms,
        s.wall_s,
        s.errors,
        s.hit_ratio() * 100.0,
        s.cold_opens,
        s.lost_histories,
    )
}

pub struct Row {
    name: String,
    stats: Vec<Stats>,
}

impl Row {
    pub fn new(name: String, passes: Vec<Pass>) -> Self {
        let stats = passes.iter().map(Stats::of).collect();
        Self { name, stats }
    }

    /// The median over the passes, with min-max when there is more than one.
    fn cell(&self, f: impl Fn(&Stats) -> f64, decimals: usize) -> String {
        self.cell_of(|s| Some(f(s)), decimals)
    }

    /// As [`Row::cell`], `—` when a pass has no such figure.
    fn cell_of(&self, f: impl Fn(&Stats) -> Option<f64>, decimals: usize) -> String {
        let Some(mut v) = self.stats.iter().map(f).collect::<Option<Vec<f64>>>() else {
            return "—".to_owned();
        };
        v.sort_by(f64::total_cmp);
        let median = v[v.len() / 2];
        if v.len() == 1 {
            format!("{median:.decimals$}")
        } else {
            format!(
                "{median:.decimals$} ({:.decimals$}-{:.decimals$})",
                v[0],
                v[v.len() - 1]
            )
        }
    }
}

pub fn print_table(rows: &[Row]) {
    println!(
        "\n| router | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | pass s | errors | cached / prompt tokens | engines' cached_total | cold opens | lost histories | turns moved |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} % | {} | {} | {} | {} |",
            r.name,
            r.cell(|s| s.ttft_p50_ms, 0),
            r.cell(|s| s.ttft_p99_ms, 0),
            r.cell(|s| s.e2e_p50_ms, 0),
            r.cell(|s| s.wall_s, 1),
            r.cell(|s| s.errors, 0),
            r.cell(|s| s.hit_ratio() * 100.0, 1),
            r.cell(|s| s.engine_cached_total, 0),
            r.cell(|s| s.cold_opens, 0),
            r.cell(|s| s.lost_histories, 0),
            r.cell_of(|s| s.moved, 0),
        );
    }
}

pub fn write_json(rows: &[Row], seeds: &[u64], run_time: Duration) -> PathBuf {
    let routers: Vec<_> = rows
        .iter()
        .map(|r| {
            json!({
                "router": r.name,
                "passes": r.stats.iter().map(Stats::json).collect::<Vec<_>>(),
            })
        })
        .collect();
    let doc = json!({
        "seeds": seeds,
        "llama_args": crate::llama::extra_args(),
        "run_time_s": run_time.as_secs_f64(),
        "routers": routers,
    });
    let path = out_dir().join("engines.json");
    std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    path
}
