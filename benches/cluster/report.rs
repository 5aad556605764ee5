//! What a run reads as: its figures, the tables, how often turns moved, and the files written.

use std::collections::BTreeMap;

use serde_json::json;

use crate::common::*;
use crate::runner::{RunResult, Stat};
use crate::setup::{CACHE_TOKENS, MAX_RUNNING, SEED, SPEED};
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
        let mut v = ttft_floors(&self.stats);
        v.sort_by(f64::total_cmp);
        percentile(&v, q)
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
        let ok: Vec<&Stat> = self.stats.iter().filter(|s| s.ok).collect();
        let mean_e2e = ok.iter().map(|s| s.e2e_ms).sum::<f64>() / ok.len().max(1) as f64;
        let total: f64 = self.served.iter().sum();
        let mean_share = total / self.served.len() as f64;
        let max_share = self.served.iter().copied().fold(0.0, f64::max);
        json!({
            "workload": self.shape.name(),
            "router": self.router.name(),
            "gpus": self.served.len(),
            "requests": self.stats.len(),
            "errors": self.errors(),
            "ttft_ms": {"p50": self.p(50.0), "p90": self.p(90.0), "p99": self.p(99.0)},
            "ttft_p99_floor_ms": self.floor(99.0),
            "mean_e2e_ms": mean_e2e,
            "throughput_rps": ok.len() as f64 / self.wall.as_secs_f64(),
            "prefix_cache_hit_ratio": self.hit_ratio,
            "load_imbalance": if mean_share > 0.0 { max_share / mean_share } else { 0.0 },
            "peak_gpu_load": self.peak_load,
            "prefixlb_routes": self.routes,
            "requests_per_gpu": self.served,
        })
    }
}

pub fn print_table(shape: Shape, results: &[&RunResult]) {
    println!(
        "\n{}: {} simulated GPUs ({MAX_RUNNING} running each), seed {SEED}, simulator speed {SPEED}x (times are wall clock)\n",
        shape.name(),
        shape.gpus()
    );
    println!(
        "{:<48} {:>8} {:>9} {:>9} {:>10} {:>7} {:>9} {:>9} {:>9}  routes",
        "router",
        "TTFT p50",
        "TTFT p90",
        "TTFT p99",
        "mean e2e",
        "errors",
        "cache hit",
        "imbalance",
        "peak load"
    );
    for r in results {
        let s = r.summary();
        let total: f64 = r.routes.values().sum();
        let routes: Vec<String> = r
            .routes
            .iter()
            .map(|(k, v)| format!("{k} {:.0}%", v / total * 100.0))
            .collect();
        println!(
            "{:<48} {:>6.0}ms {:>7.0}ms {:>7.0}ms {:>8.0}ms {:>7} {:>8.1}% {:>9.2} {:>9.0}  {}",
            r.router.name(),
            r.p(50.0),
            r.p(90.0),
            r.p(99.0),
            s["mean_e2e_ms"].as_f64().unwrap(),
            r.errors(),
            r.hit_ratio * 100.0,
            s["load_imbalance"].as_f64().unwrap(),
            r.peak_load,
            routes.join(", "),
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
        "{}: {}: {} of {} later turns left the peer of the turn before (TTFT p50 {:.0} ms, p90 {:.0} ms; those that stayed {:.0} / {:.0} ms)",
        r.shape.name(),
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
                "router": r.router.name(),
                "load": r.load.iter().map(|(t, row)| json!({"t": t, "per_gpu": row})).collect::<Vec<_>>(),
            })
        })
        .collect();
    let out = json!({
        "max_running": MAX_RUNNING, "cache_tokens": CACHE_TOKENS, "seed": SEED,
        "speed": SPEED, "results": summaries, "verdicts": verdicts, "skipped": skipped,
        "load_over_time": load,
    });
    std::fs::write(
        dir.join("results.json"),
        serde_json::to_string_pretty(&out).unwrap(),
    )
    .unwrap();
    let mut requests = String::from("workload,router,session,turn,sent_ms,ttft_ms,e2e_ms,ok\n");
    for r in results {
        for s in &r.stats {
            requests.push_str(&format!(
                "{},\"{}\",{},{},{:.1},{:.1},{:.1},{}\n",
                r.shape.name(),
                r.router.name(),
                s.session,
                s.turn,
                s.sent.as_secs_f64() * 1000.0,
                s.ttft_ms,
                s.e2e_ms,
                s.ok
            ));
        }
        if !r.access_log.is_empty() {
            let slug: String = r
                .router
                .name()
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            let path = dir.join(format!("access-{}-{slug}.log", r.shape.name()));
            std::fs::write(path, &r.access_log).unwrap();
        }
    }
    std::fs::write(dir.join("requests.csv"), requests).unwrap();
}
