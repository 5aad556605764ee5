//! What a run reads as: its figures, the tables, how often turns moved, and the files written.

use std::collections::BTreeMap;

use serde_json::json;

use crate::common::*;
use crate::runner::{RunResult, Stat};
use crate::setup::{SimModel, CACHE_TOKENS, MAX_RUNNING, SPEED, TUNING_SEEDS, VERDICT_SEEDS};
use crate::spread::Row;
use crate::verdict::ttft_floors;
use crate::workload::Shape;

impl RunResult {
    pub fn ttfts(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self
            .stats
            .iter()
            .filter(|s| s.ok)
            .map(|s| s.ttft_ms)
            .collect();
        v.sort_by(f64::total_cmp);
        v
    }

    pub fn p(&self, q: f64) -> f64 {
        percentile(&self.ttfts(), q)
    }

    /// The TTFT percentile `q` that no router could have gone below on this run's arrivals.
    pub fn floor(&self, q: f64) -> f64 {
        let mut v = ttft_floors(&self.stats, self.model.chars_per_ms());
        v.sort_by(f64::total_cmp);
        percentile(&v, q)
    }

    /// The p99 of what each answered request waited beyond its own floor: the part of the
    /// TTFT the routing (and the GPUs' queues) added.
    pub fn excess_p99(&self) -> f64 {
        let floors = ttft_floors(&self.stats, self.model.chars_per_ms());
        let mut v: Vec<f64> = self
            .stats
            .iter()
            .zip(floors)
            .filter(|(s, _)| s.ok)
            .map(|(s, floor)| s.ttft_ms - floor)
            .collect();
        v.sort_by(f64::total_cmp);
        percentile(&v, 99.0)
    }

    /// The mean of `f` over the answered requests.
    fn mean(&self, f: impl Fn(&Stat) -> f64) -> f64 {
        let ok: Vec<f64> = self.stats.iter().filter(|s| s.ok).map(f).collect();
        ok.iter().sum::<f64>() / ok.len().max(1) as f64
    }

    pub fn mean_e2e(&self) -> f64 {
        self.mean(|s| s.e2e_ms)
    }

    /// The mean TTFT: the first-token wait all requests share out, whatever its spread. A
    /// router that gives some GPUs less than their share (to spare a slow one, or to keep a
    /// hot prompt on one) trades the median for the tail; the mean is what that trade cost.
    pub fn mean_ttft(&self) -> f64 {
        self.mean(|s| s.ttft_ms)
    }

    /// The most-served GPU's requests over the mean.
    pub fn imbalance(&self) -> f64 {
        let mean = self.served.iter().sum::<f64>() / self.served.len().max(1) as f64;
        let most = self.served.iter().copied().fold(0.0, f64::max);
        if mean > 0.0 {
            most / mean
        } else {
            0.0
        }
    }

    /// The least-served GPU's requests over the mean: how far below its share one fell.
    pub fn lowest_share(&self) -> f64 {
        let mean = self.served.iter().sum::<f64>() / self.served.len().max(1) as f64;
        let least = self.served.iter().copied().fold(f64::MAX, f64::min);
        if mean > 0.0 {
            least / mean
        } else {
            0.0
        }
    }

    pub fn errors(&self) -> usize {
        self.stats.iter().filter(|s| !s.ok).count()
    }

    pub fn summary(&self) -> serde_json::Value {
        let ok = self.stats.iter().filter(|s| s.ok).count();
        json!({
            "workload": self.shape.name(),
            "model": self.model.name(),
            "seed": self.seed,
            "run": self.run,
            "router": self.router.name(),
            "gpus": self.served.len(),
            "requests": self.stats.len(),
            "errors": self.errors(),
            "ttft_ms": {"mean": self.mean_ttft(), "p50": self.p(50.0), "p90": self.p(90.0), "p99": self.p(99.0)},
            "ttft_p99_floor_ms": self.floor(99.0),
            "ttft_p99_excess_over_floor_ms": self.excess_p99(),
            "mean_e2e_ms": self.mean_e2e(),
            "throughput_rps": ok as f64 / self.wall.as_secs_f64(),
            "prefix_cache_hit_ratio": self.hit_ratio,
            "evicted_blocks": self.evictions,
            "preemptions": self.preemptions,
            "load_imbalance": self.imbalance(),
            "peak_gpu_load": self.peak_load,
            "prefixlb_routes": self.routes,
            "requests_per_gpu": self.served,
        })
    }
}

/// One shape on one model: every router's medians over the seeds, (min-max) beside.
pub fn print_table(shape: Shape, model: SimModel, rows: &[Row]) {
    let seeds: Vec<String> = rows
        .first()
        .map(|r| r.seeds().iter().map(u64::to_string).collect())
        .unwrap_or_default();
    let repeats = rows.iter().map(Row::repeats).max().unwrap_or(1);
    let over = match repeats {
        1 => String::from("medians over the seeds, (min-max) beside"),
        n => format!("{n} runs of the seeds: the median of the runs' medians over the seeds, (the runs' min-max) beside"),
    };
    println!(
        "\n{} on the {} model: {} simulated GPUs ({MAX_RUNNING} running each), seeds {}, simulator speed {SPEED}x (times are wall clock); {over}\n",
        shape.name(),
        model.name(),
        shape.gpus(),
        seeds.join(", "),
    );
    println!(
        "{:<44} {:>16} {:>16} {:>18} {:>18} {:>18} {:>11} {:>18} {:>16} {:>5} {:>10} {:>8}",
        "router",
        "TTFT mean ms",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "p99 over floor ms",
        "mean e2e ms",
        "errors",
        "cache hit %",
        "imbalance",
        "peak",
        "evicted",
        "preempt"
    );
    for row in rows {
        let (failed, all) = row.errors();
        println!(
            "{:<44} {:>16} {:>16} {:>18} {:>18} {:>18} {:>11} {:>18} {:>16} {:>5.0} {:>10.0} {:>8.0}",
            row.router.name(),
            row.mean_ttft().show(0),
            row.p(50.0).show(0),
            row.p(99.0).show(0),
            row.excess().show(0),
            row.mean_e2e().show(0),
            format!("{failed}/{all}"),
            row.hits().show(1),
            row.imbalance().show(2),
            row.peak_load(),
            row.evictions(),
            row.preemptions(),
        );
    }
}

/// How often prefixlb sent a turn away from the peer of the turn before, and what those turns'
/// first tokens cost against the turns that stayed, from its access log.
pub fn moves(r: &RunResult) -> Option<String> {
    // (session, turn) -> (peer, ttft)
    let mut turns = BTreeMap::new();
    for line in r.access_log.lines() {
        let field = |name: &str| {
            line.split(' ')
                .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
        };
        let (Some(peer), Some(id), Some(ttft)) =
            (field("peer"), field("request_id"), field("ttft_ms"))
        else {
            continue;
        };
        let Some((session, turn)) = id.rsplit_once("-t") else {
            continue;
        };
        if let (Ok(turn), Ok(ttft)) = (turn.parse::<usize>(), ttft.parse::<f64>()) {
            turns.insert((session.to_owned(), turn), (peer.to_owned(), ttft));
        }
    }
    let (mut moved, mut stayed) = (Vec::new(), Vec::new());
    for ((session, turn), (peer, ttft)) in &turns {
        let Some(before) = turn
            .checked_sub(1)
            .and_then(|t| turns.get(&(session.clone(), t)))
        else {
            continue;
        };
        if before.0 == *peer {
            &mut stayed
        } else {
            &mut moved
        }
        .push(*ttft);
    }
    if moved.is_empty() && stayed.is_empty() {
        return None;
    }
    moved.sort_by(f64::total_cmp);
    stayed.sort_by(f64::total_cmp);
    Some(format!(
        "{} on {}, seed {}: {}: {} of {} later turns left the peer of the turn before (TTFT p50 {:.0} ms, p90 {:.0} ms; those that stayed {:.0} / {:.0} ms)",
        r.shape.name(),
        r.model.name(),
        r.seed,
        r.router.name(),
        moved.len(),
        moved.len() + stayed.len(),
        percentile(&moved, 50.0),
        percentile(&moved, 90.0),
        percentile(&stayed, 50.0),
        percentile(&stayed, 90.0),
    ))
}

/// `results.json`, `requests.csv` and prefixlb's access logs, in `dir`.
pub fn write_files(
    dir: &std::path::Path,
    results: &[RunResult],
    verdicts: &[String],
    skipped: &BTreeMap<String, String>,
) {
    let summaries: Vec<serde_json::Value> = results.iter().map(RunResult::summary).collect();
    let load: Vec<serde_json::Value> = results
        .iter()
        .map(|r| {
            json!({
                "workload": r.shape.name(),
                "model": r.model.name(),
                "seed": r.seed,
                "run": r.run,
                "router": r.router.name(),
                "load": r.load.iter().map(|(t, row)| json!({"t": t, "per_gpu": row})).collect::<Vec<_>>(),
            })
        })
        .collect();
    let out = json!({
        "max_running": MAX_RUNNING, "cache_tokens": CACHE_TOKENS,
        "tuning_seeds": TUNING_SEEDS, "verdict_seeds": VERDICT_SEEDS, "speed": SPEED, "results": summaries, "verdicts": verdicts, "skipped": skipped,
        "load_over_time": load,
    });
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&out).unwrap(),
    )
    .unwrap();
    let mut requests =
        String::from("workload,model,seed,router,session,turn,sent_ms,ttft_ms,e2e_ms,ok,run\n");
    for r in results {
        for s in &r.stats {
            requests.push_str(&format!(
                "{},{},{},\"{}\",{},{},{:.1},{:.1},{:.1},{},{}\n",
                r.shape.name(),
                r.model.name(),
                r.seed,
                r.router.name(),
                s.session,
                s.turn,
                s.sent.as_secs_f64() * 1000.0,
                s.ttft_ms,
                s.e2e_ms,
                s.ok,
                r.run
            ));
        }
        if !r.access_log.is_empty() {
            let slug: String = r
                .router
                .name()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            // The first run's names are those of a command without repeats; the others count
            // from 1, as the progress lines do (`run` in the JSON and CSV counts from 0).
            let run = match r.run {
                0 => String::new(),
                n => format!("-run{}", n + 1),
            };
            let path = dir.join(format!(
                "access-{}-{}-{}{run}-{slug}.log",
                r.shape.name(),
                r.model.name(),
                r.seed
            ));
            std::fs::write(path, &r.access_log).unwrap();
        }
    }
    std::fs::write(dir.join("requests.csv"), requests).unwrap();
}
