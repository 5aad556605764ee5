//! The cluster benchmark: prefixlb and the routers people would pick instead, in front of the
//! same simulated GPUs, on the same seeded workloads, side by side in one run.
//!
//! `cargo bench --bench cluster` prints a table per workload and writes `results.json` and
//! `results.svg` to `target/bench-results/` (or `$BENCH_OUT`), with every request's times in
//! `requests.csv` and prefixlb's access logs beside them: each request's `x-request-id` is
//! `<workload>-<session>-t<turn>`, so a log line tells which peer each turn went to. Arguments
//! filter: a workload name (`hot`, `chats`, `long`, `prompts`) or a router name keeps only
//! those.
//!
//! The routers: prefixlb (its default policy, with the key from the body and from a session
//! header; four processes in front of the same GPUs, told of each other and not;
//! `bounded_consistent_hash`), vllm-router `sticky_least_loaded` and `consistent_hash` with
//! the session header, sglang-router `cache_aware` (both from PyPI, into a venv the bench
//! makes), HAProxy `roundrobin` and `leastconn` (the Debian package). A router that cannot be installed is skipped with a line
//! saying why.
//!
//! Each run also gets a floor: the TTFT p99 no router could have gone below on its arrivals
//! (see [`verdict::ttft_floors`]), printed with prefixlb's verdict, so that a target under it reads as
//! out of reach rather than missed.
//!
//! The workloads, all streamed, sessions resending their whole history every turn and thinking
//! between turns:
//! - `hot`: six departments, each with its long system prompt; one has half of all sessions
//!   (hundreds of doctors on one prompt) and sends the whole conversation as one completions
//!   prompt, whose key (its first 2048 characters) is the shared template: one hot key. A third
//!   of the sessions arrive in a burst at the start.
//! - `chats`: many independent chats, each with its own system prompt, arriving at random.
//! - `long`: bursts of sessions asking about one of four long documents (20 to 62 KB, the
//!   largest near the 64 KiB peek limit).
//! - `prompts`: raw-prompt traffic on six GPUs: three departments, each with a 6,000-token
//!   system prompt (seven sessions in ten in one of them), sessions of five turns sent as one
//!   growing `/v1/completions` prompt, a burst of thirty at the start.

#[path = "../common/mod.rs"]
mod common;
mod report;
mod routers;
mod runner;
mod setup;
mod svg;
mod verdict;
mod workload;

use std::collections::BTreeMap;

use common::*;
use report::{moves, print_table, write_files};
use routers::ROUTERS;
use runner::{run, RunResult};
use workload::SHAPES;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes --bench; other arguments filter workloads and routers.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let shape_filter: Vec<&String> = filter
        .iter()
        .filter(|f| SHAPES.iter().any(|s| s.name() == f.as_str()))
        .collect();
    let router_filter: Vec<&String> = filter
        .iter()
        .filter(|f| !shape_filter.contains(f))
        .collect();
    let mut results = Vec::new();
    let mut skipped: BTreeMap<String, String> = BTreeMap::new();
    for shape in SHAPES {
        if !shape_filter.is_empty() && !shape_filter.iter().any(|f| *f == shape.name()) {
            continue;
        }
        for router in ROUTERS {
            let name = router.name();
            if !router_filter.is_empty() && !router_filter.iter().any(|f| name.contains(f.as_str()))
            {
                continue;
            }
            if skipped.contains_key(&name) {
                continue;
            }
            eprintln!("{}: running {name} ...", shape.name());
            match run(shape, router).await {
                Ok(r) => results.push(r),
                Err(why) => {
                    println!("skipped {name}: {why}");
                    skipped.insert(name, why);
                }
            }
        }
    }
    let mut verdicts = Vec::new();
    let mut departures = Vec::new();
    for shape in SHAPES {
        let runs: Vec<&RunResult> = results.iter().filter(|r| r.shape == shape).collect();
        if runs.is_empty() {
            continue;
        }
        print_table(shape, &runs);
        verdicts.extend(verdict::verdict(shape, &runs));
        departures.extend(runs.iter().filter_map(|r| moves(r)));
    }
    println!();
    for v in &verdicts {
        println!("{v}");
    }
    println!();
    for d in &departures {
        println!("{d}");
    }
    let dir = out_dir();
    write_files(&dir, &results, &verdicts, &skipped);
    if let Err(e) = svg::draw(&results, &dir.join("results.svg")) {
        eprintln!("could not draw the SVG: {e}");
    }
    println!(
        "\nwrote {}/results.json, results.svg, requests.csv and prefixlb's access logs",
        dir.display()
    );
}
