//! prefixlb against the peers, and the floor no router could go below.

use crate::routers::Router;
use crate::runner::{RunResult, Stat};
use crate::setup::{MAX_IN_FLIGHT, PREFILL_TOKENS_PER_SEC};
use crate::workload::Shape;

/// The least TTFT each request could have had, whatever the router: the part of its prompt
/// that could not have been prefilled anywhere by the time it came, at the simulator's prefill
/// rate. GPUs are taken as unlimited and idle and caches as keeping everything, so it is a
/// floor, not an estimate. A prefix is cached at the earliest once the first request that
/// carried it has prefilled what no request before that one carried: two readers of one cold
/// document in a burst both wait out most of its prefill.
pub fn ttft_floors(stats: &[Stat]) -> Vec<f64> {
    let chars_per_ms = PREFILL_TOKENS_PER_SEC * 4.0 / 1000.0;
    let mut order: Vec<&Stat> = stats.iter().collect();
    order.sort_by_key(|s| s.sent);
    let at = |s: &Stat| s.sent.as_secs_f64() * 1000.0;
    // How much of each prompt some request sent before it carried.
    let mut carried = vec![0usize; order.len()];
    let mut floors = Vec::with_capacity(order.len());
    for (i, s) in order.iter().enumerate() {
        let mine = s.prompt.as_bytes();
        let shared: Vec<usize> = order[..i]
            .iter()
            .map(|e| common_prefix(mine, e.prompt.as_bytes()))
            .collect();
        // reach[j]: the longest prefix of this prompt carried by request j or one before it.
        let reach: Vec<usize> = shared
            .iter()
            .scan(0, |most, &l| {
                *most = l.max(*most);
                Some(*most)
            })
            .collect();
        carried[i] = reach.last().copied().unwrap_or(0);
        let mut best = mine.len() as f64 / chars_per_ms;
        for &c in &shared {
            let first = reach.partition_point(|&r| r < c);
            let cached_at =
                at(order[first]) + c.saturating_sub(carried[first]) as f64 / chars_per_ms;
            let own = (mine.len() - c) as f64 / chars_per_ms;
            best = best.min((cached_at - at(s)).max(0.0) + own);
        }
        floors.push(best);
    }
    floors
}

pub fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 64 <= n && a[i..i + 64] == b[i..i + 64] {
        i += 64;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// How prefixlb's default policy compares with the best of the peers on one workload, as the
/// routing issue asks: p50 within 5% of the best, p99 at most 0.8 of the best, hits at least
/// the best of the peers that do not melt (p99 within 2 × the best) minus one point, no errors;
/// on `prompts`, as the block-record issue adds, no GPU below half of the mean share.
pub fn verdict(shape: Shape, results: &[&RunResult]) -> Vec<String> {
    let peers: Vec<&&RunResult> = results.iter().filter(|r| r.router.is_peer()).collect();
    if peers.is_empty() {
        return Vec::new();
    }
    let best_p50 = peers.iter().map(|r| r.p(50.0)).fold(f64::MAX, f64::min);
    let best_p99 = peers.iter().map(|r| r.p(99.0)).fold(f64::MAX, f64::min);
    let best_hits = peers
        .iter()
        .filter(|r| r.p(99.0) <= 2.0 * best_p99)
        .map(|r| r.hit_ratio)
        .fold(0.0, f64::max);
    let mut lines = Vec::new();
    for r in results.iter().filter(|r| {
        matches!(
            r.router,
            Router::Prefixlb {
                policy: "least_cost",
                replicas: 1,
                ..
            }
        )
    }) {
        let p50 = r.p(50.0) / best_p50;
        let p99 = r.p(99.0) / best_p99;
        let hits = (r.hit_ratio - best_hits) * 100.0;
        let lowest = r.lowest_share();
        let spread = shape != Shape::Prompts || lowest >= 0.5;
        let met = p50 <= 1.05 && p99 <= 0.8 && hits >= -1.0 && r.errors() == 0 && spread;
        // Below the floor of its own arrivals no router could go: a p99 target under it is
        // out of reach on this run, whatever the routing.
        let floor = r.floor(99.0);
        let reach = if floor > 0.8 * best_p99 {
            format!(", out of reach: the arrivals' p99 floor is {floor:.0} ms, 0.8× the best peer's {:.0} ms", 0.8 * best_p99)
        } else {
            format!(", p99 floor {floor:.0} ms")
        };
        lines.push(format!(
            "{}: {}: p50 {p50:.2}× the best peer's, p99 {p99:.2}×{reach}, hits {hits:+.1} points, {} errors, least-served GPU {lowest:.2}× the mean: {}",
            shape.name(),
            r.router.name(),
            r.errors(),
            if met { "meets the targets" } else { "misses" }
        ));
    }
    // Replicas against one process, key from the body.
    let one = results.iter().find(|r| {
        r.router
            == Router::Prefixlb {
                policy: "least_cost",
                replicas: 1,
                header: false,
                placement: false,
                exchange: false,
            }
    });
    let many = results
        .iter()
        .filter(|r| matches!(r.router, Router::Prefixlb { replicas, .. } if replicas > 1));
    for many in many {
        let Some(one) = one else { break };
        lines.push(format!(
            "{}: {}: hits {:.3}× one process's, p50 {:.2}×, p99 {:.2}×, peak GPU load {:.0} (max_in_flight {MAX_IN_FLIGHT})",
            shape.name(),
            many.router.name(),
            many.hit_ratio / one.hit_ratio.max(1e-9),
            many.p(50.0) / one.p(50.0),
            many.p(99.0) / one.p(99.0),
            many.peak_load,
        ));
    }
    lines
}
