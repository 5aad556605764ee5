//! The cluster benchmark: prefixlb and the routers people would pick instead, in front of the
//! same simulated GPUs, on the same seeded workloads, side by side in one run.
//!
//! `cargo bench --bench cluster` runs every workload on both simulator models (`lane` and
//! `engine`, see [`setup::SimModel`]) and the three verdict seeds ([`setup::VERDICT_SEEDS`]),
//! prints a table per workload and model (medians over the seeds, min-max beside) and
//! prefixlb's verdicts, and writes `results.json` and `results.svg` to
//! `target/bench-results/` (or `$BENCH_OUT`), with every request's times in `requests.csv`
//! and prefixlb's access logs beside them: each request's `x-request-id` is
//! `<workload>-<session>-t<turn>`, so a log line tells which peer each turn went to. It exits
//! non-zero when a verdict is refused. Arguments filter: a workload name (`hot`, `chats`,
//! `long`, `prompts`, `histories`), a model (`lane`, `engine`), a seed (a number), `tuning`
//! (the tuning seeds instead of the verdict seeds: tables, no verdict), `runs=N` (every
//! router runs the seeds N times, the tables and verdicts then read the median of the runs'
//! medians, the runs' min-max beside), and anything else a router's name (whole, or a part
//! of it) keeps only those. `BENCH_DEBUG_DIR` keeps each
//! prefixlb run's standard error there (with `PREFIXLB_TEST_LOG` at debug for `least_cost`,
//! every decision's prices).
//!
//! The routers: prefixlb (its default policy, with the key from the body and from a session
//! header; four processes in front of the same GPUs, told of each other and not;
//! `bounded_consistent_hash`), vllm-router `sticky_least_loaded` and `consistent_hash` with
//! the session header, sglang-router `cache_aware` (both from PyPI, into a venv the bench
//! makes), SMG 1.13 `cache_aware`, `prefix_hash` and `cache_aware` sticky on the session
//! header (from PyPI, into a venv of its own), HAProxy `roundrobin`, `leastconn` and its
//! bounded consistent hash of the session header (the Debian package); each configured for
//! GPUs of eight running requests as its documentation advises (see `common/peers.rs`). A
//! router that cannot be installed is skipped with a line saying why, and every verdict it
//! was expected in is refused.
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
//! - `histories`: long chats (10 to 14 turns of 1.5-3 KB) whose histories together reach
//!   about twice the GPUs' caches, so that evictions decide the hits.

#[path = "../common/mod.rs"]
mod common;
mod report;
mod routers;
mod runner;
mod setup;
mod spread;
mod svg;
mod verdict;
mod workload;

use std::collections::BTreeMap;

use common::*;
use report::{moves, print_table, write_files};
use routers::{Router, ROUTERS};
use runner::{run, RunResult};
use setup::{SimModel, MODELS, TUNING_SEEDS, VERDICT_SEEDS};
use workload::{Shape, SHAPES};

/// What the command line keeps: empty lists keep all.
struct Filter {
    shapes: Vec<Shape>,
    models: Vec<SimModel>,
    seeds: Vec<u64>,
    routers: Vec<Router>,
    /// Whether a seed is not a verdict seed: then no verdict is read.
    tuning: bool,
    /// How many times every router runs the seeds (`runs=N`): one run's verdict moves with
    /// the timing of the two cores by more than the targets' margins on some shapes.
    runs: usize,
}

impl Filter {
    fn from_args() -> Filter {
        // `cargo bench` passes --bench; other arguments filter.
        let args: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with("--"))
            .collect();
        let runs = args
            .iter()
            .find_map(|a| a.strip_prefix("runs="))
            .map_or(1, |n| n.parse().expect("runs=N takes a number"))
            .max(1);
        let args: Vec<String> = args
            .into_iter()
            .filter(|a| !a.starts_with("runs="))
            .collect();
        let tuning = args.iter().any(|a| a == "tuning");
        let all_seeds = if tuning { TUNING_SEEDS } else { VERDICT_SEEDS };
        let mut seeds: Vec<u64> = args.iter().filter_map(|a| a.parse().ok()).collect();
        if seeds.is_empty() {
            seeds = all_seeds.to_vec();
        }
        // A seed named twice runs once: `runs=N` repeats.
        seeds.sort_unstable();
        seeds.dedup();
        let shapes: Vec<Shape> = SHAPES
            .into_iter()
            .filter(|s| args.iter().any(|a| a == s.name()))
            .collect();
        let models: Vec<SimModel> = MODELS
            .into_iter()
            .filter(|m| args.iter().any(|a| a == m.name()))
            .collect();
        let rest: Vec<&String> = args
            .iter()
            .filter(|a| {
                *a != "tuning"
                    && a.parse::<u64>().is_err()
                    && !shapes.iter().any(|s| s.name() == a.as_str())
                    && !models.iter().any(|m| m.name() == a.as_str())
            })
            .collect();
        // A router's whole name keeps that one only; a part of a name keeps every router
        // whose name holds it.
        let routers = ROUTERS
            .into_iter()
            .filter(|r| {
                let name = r.name();
                rest.is_empty()
                    || rest.iter().any(|f| {
                        name == **f
                            || (!ROUTERS.iter().any(|o| o.name() == **f)
                                && name.contains(f.as_str()))
                    })
            })
            .collect();
        // A verdict reads the verdict seeds only: any other seed asked for makes a tuning run.
        let tuning = tuning || seeds.iter().any(|s| !VERDICT_SEEDS.contains(s));
        Filter {
            shapes: if shapes.is_empty() {
                SHAPES.to_vec()
            } else {
                shapes
            },
            models: if models.is_empty() {
                MODELS.to_vec()
            } else {
                models
            },
            seeds,
            routers,
            tuning,
            runs,
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let filter = Filter::from_args();
    let mut results = Vec::new();
    let mut skipped: BTreeMap<String, String> = BTreeMap::new();
    // Repeats outermost: a drift of the machine's pace over the command then falls on every
    // router alike.
    for repeat in 0..filter.runs {
        for &shape in &filter.shapes {
            for &model in &filter.models {
                for &seed in &filter.seeds {
                    for &router in &filter.routers {
                        let name = router.name();
                        if skipped.contains_key(&name) {
                            continue;
                        }
                        eprintln!(
                            "{} on {}, seed {seed}, run {}: running {name} ...",
                            shape.name(),
                            model.name(),
                            repeat + 1
                        );
                        match run(shape, router, model, seed).await {
                            Ok(r) => results.push(RunResult { run: repeat, ..r }),
                            Err(why) => {
                                println!("skipped {name}: {why}");
                                skipped.insert(name, why);
                            }
                        }
                    }
                }
            }
        }
    }
    let expected: Vec<Router> = filter
        .routers
        .iter()
        .copied()
        .filter(|r| r.is_peer())
        .collect();
    let mut verdicts = Vec::new();
    let mut refused = false;
    let mut departures = Vec::new();
    for &shape in &filter.shapes {
        for &model in &filter.models {
            let runs: Vec<&RunResult> = results
                .iter()
                .filter(|r| r.shape == shape && r.model == model)
                .collect();
            let rows = spread::rows(&runs);
            print_table(shape, model, &rows);
            if !filter.tuning {
                let v =
                    verdict::verdict(shape, model, &rows, &expected, &filter.seeds, filter.runs);
                refused |= v.refused;
                verdicts.extend(v.lines);
            }
            // Where prefixlb's turns went, on the first seed of the first run only: the others
            // read alike.
            departures.extend(
                runs.iter()
                    .filter(|r| Some(&r.seed) == filter.seeds.first() && r.run == 0)
                    .filter_map(|r| moves(r)),
            );
        }
    }
    if filter.tuning {
        println!("\nnot the verdict seeds: tables only, no verdict is read from them");
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
    if refused {
        println!("a verdict was refused: an expected peer did not run on every seed");
        std::process::exit(1);
    }
}
