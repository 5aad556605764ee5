//! The numbers of each pass, the table (medians over the seeds, min-max beside), the same over
//! several runs (the median of each run's medians), prefixlb against the best peer, and the JSON.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::json;

use crate::common::spread::Spread;
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
    /// Which run of the bench's `runs=N` the passes belong to, from 0.
    run: usize,
    stats: Vec<Stats>,
}

/// `median (min-max)` of `v`, the value alone when there is one, `—` when a figure is missing.
fn cell(v: Option<Vec<f64>>, decimals: usize) -> String {
    match v {
        None => "—".to_owned(),
        Some(v) if v.len() == 1 => format!("{:.decimals$}", v[0]),
        Some(v) => Spread::of(v).show(decimals),
    }
}

impl Row {
    pub fn new(name: String, run: usize, passes: Vec<Pass>) -> Self {
        let stats = passes.iter().map(Stats::of).collect();
        Self { name, run, stats }
    }

    /// The median over the passes, `None` when a pass has no such figure.
    fn median(&self, f: impl Fn(&Stats) -> Option<f64>) -> Option<f64> {
        let v = self.stats.iter().map(f).collect::<Option<Vec<f64>>>()?;
        Some(Spread::of(v).median)
    }

    /// Whether a turn of any pass failed: such a router's figures are of the turns it served.
    fn failed(&self) -> bool {
        self.stats.iter().any(|s| s.errors > 0.0)
    }
}

/// The routers of `rows`, each once, in their order.
fn names(rows: &[Row]) -> Vec<&str> {
    let mut names = Vec::new();
    for r in rows {
        if !names.contains(&r.name.as_str()) {
            names.push(r.name.as_str());
        }
    }
    names
}

/// A figure of a pass, and its decimals in a table.
type Figure = (fn(&Stats) -> Option<f64>, usize);

const COLUMNS: [Figure; 10] = [
    (|s| Some(s.ttft_p50_ms), 0),
    (|s| Some(s.ttft_p99_ms), 0),
    (|s| Some(s.e2e_p50_ms), 0),
    (|s| Some(s.wall_s), 1),
    (|s| Some(s.errors), 0),
    (|s| Some(s.hit_ratio() * 100.0), 1),
    (|s| Some(s.engine_cached_total), 0),
    (|s| Some(s.cold_opens), 0),
    (|s| Some(s.lost_histories), 0),
    (|s| s.moved, 0),
];

/// Prints a table of one run's `rows`, one line a router: its median over the passes with
/// their min-max. Then prefixlb's rows against the best peer's.
pub fn print_table(rows: &[Row]) {
    table(rows, false);
}

/// The table of `rows` from one run, or (`over_runs`) from several: each router's median of
/// its runs' medians with theirs, one run's median alone for a router that ran once.
fn table(rows: &[Row], over_runs: bool) {
    println!(
        "\n| router | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | pass s | errors | cached / prompt tokens, % | engines' cached_total | cold opens | lost histories | turns moved |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for name in names(rows) {
        let of: Vec<&Row> = rows.iter().filter(|r| r.name == name).collect();
        let cells: Vec<String> = COLUMNS
            .iter()
            .map(|&(f, decimals)| match of.as_slice() {
                [one] if !over_runs => cell(one.stats.iter().map(f).collect(), decimals),
                runs => cell(runs.iter().map(|r| r.median(f)).collect(), decimals),
            })
            .collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    verdict(rows);
}

/// The table over several runs (`rows` from every run, in order): each router's median of its
/// runs' medians, the runs' min-max beside.
pub fn print_over_runs(rows: &[Row], runs: usize, engines: &str) {
    println!(
        "\n{engines} engines, medians over {runs} runs (each run's median over its seeds; the runs' min-max beside):"
    );
    for name in names(rows) {
        let ran = rows.iter().filter(|r| r.name == name).count();
        if ran < runs {
            println!("{name}: {ran} runs of {runs} (skipped in the others)");
        }
    }
    table(rows, true);
}

/// prefixlb's rows against the best other router's figures (the routing issue's targets read
/// TTFT p50 and p99 as ratios, the cached share in points), each router's figure the median
/// of its runs' medians. A peer that failed a turn is left out of "best", and said so.
fn verdict(rows: &[Row]) {
    let figure = |name: &str, f: fn(&Stats) -> f64| {
        let runs = rows
            .iter()
            .filter(|r| r.name == name)
            .filter_map(|r| r.median(|s| Some(f(s))));
        Spread::of(runs.collect()).median
    };
    let (ours, peers): (Vec<&str>, Vec<&str>) = names(rows)
        .into_iter()
        .partition(|n| n.starts_with("prefixlb"));
    let (failed, peers): (Vec<&str>, Vec<&str>) = peers
        .into_iter()
        .partition(|&n| rows.iter().any(|r| r.name == n && r.failed()));
    for name in failed {
        println!("{name}: failed turns, left out of the best peer's figures");
    }
    if peers.is_empty() {
        return;
    }
    let best = |f: fn(&Stats) -> f64, pick: fn(f64, f64) -> f64| {
        let mut figures = peers.iter().map(|&n| (figure(n, f), n));
        let first = figures.next().expect("a peer");
        figures.fold(first, |a, b| if pick(a.0, b.0) == a.0 { a } else { b })
    };
    let (p50, p50_by) = best(|s| s.ttft_p50_ms, f64::min);
    let (p99, p99_by) = best(|s| s.ttft_p99_ms, f64::min);
    let (hits, hits_by) = best(|s| s.hit_ratio() * 100.0, f64::max);
    for name in ours {
        println!(
            "{name}: TTFT p50 {:.2}x the best peer's ({p50_by}), p99 {:.2}x ({p99_by}), cached {:+.1} points ({hits_by})",
            figure(name, |s| s.ttft_p50_ms) / p50,
            figure(name, |s| s.ttft_p99_ms) / p99,
            figure(name, |s| s.hit_ratio() * 100.0) - hits,
        );
    }
}

pub fn write_json(rows: &[Row], seeds: &[u64], run_time: Duration) -> PathBuf {
    let routers: Vec<_> = rows
        .iter()
        .map(|r| {
            json!({
                "router": r.name,
                "run": r.run,
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
