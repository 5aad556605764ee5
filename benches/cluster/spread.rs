//! One router's runs on one shape and model, over the seeds: medians and spreads.

use std::collections::BTreeSet;

pub use crate::common::spread::Spread;
use crate::routers::{Router, ROUTERS};
use crate::runner::RunResult;

/// A router's runs on one shape and model, one per seed and repeat.
pub struct Row<'a> {
    pub router: Router,
    pub runs: Vec<&'a RunResult>,
}

impl Row<'_> {
    /// The median over the seeds and their min-max; with repeats, each repeat's median over
    /// its seeds, then the median of those and their min-max, so that the spread says how far
    /// one run's verdict can move.
    fn spread(&self, f: impl Fn(&RunResult) -> f64) -> Spread {
        let repeats = self.run_numbers();
        if repeats.len() == 1 {
            return Spread::of(self.runs.iter().map(|r| f(r)).collect());
        }
        Spread::of(
            repeats
                .into_iter()
                .map(|n| {
                    let one = self.runs.iter().filter(|r| r.run == n);
                    Spread::of(one.map(|r| f(r)).collect()).median
                })
                .collect(),
        )
    }

    /// How many repeats of its seeds it ran (the last one possibly cut short: the verdict
    /// refuses a row without every pass).
    pub fn repeats(&self) -> usize {
        self.run_numbers().len()
    }

    /// The repeats it ran, by number.
    fn run_numbers(&self) -> BTreeSet<usize> {
        self.runs.iter().map(|r| r.run).collect()
    }

    /// TTFT percentile `q`, ms.
    pub fn p(&self, q: f64) -> Spread {
        self.spread(|r| r.p(q))
    }

    /// The p99 of each request's TTFT minus its floor, ms.
    pub fn excess(&self) -> Spread {
        self.spread(RunResult::excess_p99)
    }

    pub fn floor(&self) -> Spread {
        self.spread(|r| r.floor(99.0))
    }

    /// Prefix-cache hit ratio, in percent.
    pub fn hits(&self) -> Spread {
        self.spread(|r| r.hit_ratio * 100.0)
    }

    pub fn mean_e2e(&self) -> Spread {
        self.spread(RunResult::mean_e2e)
    }

    pub fn mean_ttft(&self) -> Spread {
        self.spread(RunResult::mean_ttft)
    }

    pub fn imbalance(&self) -> Spread {
        self.spread(RunResult::imbalance)
    }

    pub fn lowest_share(&self) -> Spread {
        self.spread(RunResult::lowest_share)
    }

    /// Median blocks evicted over the seeds (of the runs' medians, with repeats).
    pub fn evictions(&self) -> f64 {
        self.spread(|r| r.evictions).median
    }

    pub fn preemptions(&self) -> f64 {
        self.spread(|r| r.preemptions).median
    }

    pub fn peak_load(&self) -> f64 {
        self.runs.iter().map(|r| r.peak_load).fold(0.0, f64::max)
    }

    /// Failed requests and all requests, over the seeds and every repeat.
    pub fn errors(&self) -> (usize, usize) {
        let failed = self.runs.iter().map(|r| r.errors()).sum();
        let all = self.runs.iter().map(|r| r.stats.len()).sum();
        (failed, all)
    }

    /// Whether it failed more than 1% of its requests: then it is no one's "best".
    pub fn failing(&self) -> bool {
        let (failed, all) = self.errors();
        failed * 100 > all
    }

    /// The seeds it ran, each once.
    pub fn seeds(&self) -> Vec<u64> {
        let mut seeds: Vec<u64> = self.runs.iter().map(|r| r.seed).collect();
        seeds.sort_unstable();
        seeds.dedup();
        seeds
    }
}

/// The runs grouped by router, in [`ROUTERS`]' order.
pub fn rows<'a>(runs: &[&'a RunResult]) -> Vec<Row<'a>> {
    ROUTERS
        .iter()
        .map(|router| Row {
            router: *router,
            runs: runs
                .iter()
                .copied()
                .filter(|r| r.router == *router)
                .collect(),
        })
        .filter(|row| !row.runs.is_empty())
        .collect()
}
