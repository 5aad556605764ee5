//! The routers on real engines: two `llama-server` engines (llama.cpp on the CPU, a tiny
//! random-weight Llama, from the real-engine tests' harness), then two vLLM engines (its CPU
//! build, a tiny Llama of the same shape; see [`vllm`]), behind each router in turn, on one
//! seeded multi-turn workload, each pass starting with cold caches (llama.cpp's engines
//! restarted, vLLM's prefix caches emptied).
//!
//! `cargo bench --bench engines [-- SEED... ROUTER... llama|vllm runs=N]`: numbers are seeds
//! (one pass per seed and router; medians with min-max when more than one), `llama` or `vllm`
//! keeps those engines only, `runs=N` runs every router's seeds in turn, then again for each
//! further run, and adds a table of the medians of the runs' medians, anything else keeps the
//! routers whose name holds it (or is it, ending in `$`). Prints a table per engine and run,
//! with prefixlb's rows against the best peer's figures, and writes
//! `target/bench-results/engines.json` (or `$BENCH_OUT`). vLLM engines that cannot be
//! installed or started are skipped with the reason, and the run exits non-zero.
//! `BENCH_LLAMA_ARGS` adds arguments to every `llama-server` (`-sps 0`: see
//! `docs/real-engines.md`). `BENCH_DEBUG_DIR` keeps prefixlb's
//! standard error of each pass there, named by router, engines, seed (and run); with
//! `PREFIXLB_TEST_LOG=info,prefixlb::routing::policy::least_cost=debug` it holds every
//! decision's prices (`docs/operations.md`, the access log).
//!
//! What is measured per router: TTFT p50/p99 and end-to-end p50 of the streamed turns as the
//! client sees them, the pass's wall time, failed turns, and the engines' own word on reuse:
//! the cached prompt tokens each final chunk reports (`timings.cache_n`) over all prompt
//! tokens, and `llamacpp:prompt_tokens_cached_total` scraped from each engine before it stops.
//! From those reports, for every router: the sessions that opened where their system prompt
//! was cold, and the later turns that found their history gone (prefilled again); from
//! prefixlb's access log, the turns it moved.
//!
//! The routers' set-up is the cluster bench's (`benches/cluster/routers.rs`), scaled to two
//! slots an engine; SMG polls no `/v1/loads`, which llama.cpp does not serve (see
//! `common/peers.rs`).

#[path = "../common/mod.rs"]
mod common;
// The harness and the stream reader are the real-engine tests' own; the bench uses part.
#[allow(dead_code)]
#[path = "../../tests/real_engines/llama.rs"]
mod llama;
mod report;
#[allow(dead_code)]
#[path = "../cluster/routers.rs"]
mod routers;
mod run;
mod setup;
#[allow(dead_code)]
#[path = "../../tests/real_engines/stream.rs"]
mod stream;
mod vllm;
mod workload;

use std::time::Instant;

use routers::Router;
use run::Engines;

/// The seed of a run that names none.
const SEED: u64 = 20270101;

const ROUTERS: [Router; 7] = [
    Router::Prefixlb {
        policy: "least_cost",
        replicas: 1,
        header: false,
        placement: false,
        exchange: false,
    },
    Router::Prefixlb {
        policy: "least_cost",
        replicas: 1,
        header: true,
        placement: false,
        exchange: false,
    },
    Router::Smg {
        policy: "cache_aware",
        sticky: false,
    },
    Router::Smg {
        policy: "cache_aware",
        sticky: true,
    },
    Router::Vllm("consistent_hash"),
    Router::Vllm("sticky_least_loaded"),
    Router::Haproxy("roundrobin"),
];

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let mut seeds: Vec<u64> = args.iter().filter_map(|a| a.parse().ok()).collect();
    if seeds.is_empty() {
        seeds.push(SEED);
    }
    let runs: usize = args
        .iter()
        .find_map(|a| a.strip_prefix("runs="))
        .map_or(1, |n| n.parse().expect("runs=N takes a number"))
        .max(1);
    let only = |kind: &str| args.iter().any(|a| a == kind);
    let (llama_only, vllm_only) = (only("llama"), only("vllm"));
    let names: Vec<&String> = args
        .iter()
        .filter(|a| a.parse::<u64>().is_err() && *a != "llama" && *a != "vllm")
        .filter(|a| !a.starts_with("runs="))
        .collect();
    let routers: Vec<Router> = ROUTERS
        .into_iter()
        .filter(|r| names.is_empty() || names.iter().any(|n| named(&r.name(), n)))
        .collect();
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut skipped = false;
    if !vllm_only {
        let setup = llama::Setup::find();
        let extra = llama::extra_args();
        if !extra.is_empty() {
            println!("llama-server run with {}", extra.join(" "));
        }
        rows.extend(over_runs(&Engines::Llama(&setup), &routers, &seeds, runs).await);
    }
    if !llama_only {
        let logs = tempfile::tempdir().expect("a temporary directory");
        match vllm::Engines::start(2, logs.path()).await {
            Ok(engines) => {
                println!("vLLM engines up in {:.0?}", engines.started_in);
                rows.extend(over_runs(&Engines::Vllm(&engines), &routers, &seeds, runs).await);
            }
            Err(e) => {
                println!("vLLM engines skipped: {e}");
                skipped = true;
            }
        }
    }
    let path = report::write_json(&rows, &seeds, started.elapsed());
    println!("run time {:.0?}; {}", started.elapsed(), path.display());
    if skipped {
        std::process::exit(1);
    }
}

/// Whether a router's `name` is asked for by `filter`: a part of the name, or the whole name
/// when the filter ends in `$` (`"prefixlb least_cost$"` leaves out its session-header row).
fn named(name: &str, filter: &str) -> bool {
    match filter.strip_suffix('$') {
        Some(whole) => name == whole,
        None => name.contains(filter),
    }
}

/// Every router's passes in front of `engines`, `runs` times over, each run's table and, with
/// more than one, the table over the runs.
async fn over_runs(
    engines: &Engines<'_>,
    routers: &[Router],
    seeds: &[u64],
    runs: usize,
) -> Vec<report::Row> {
    let mut rows = Vec::new();
    for run in 0..runs {
        if runs > 1 {
            println!("\nrun {} of {runs}, {} engines", run + 1, engines.name());
        }
        let tag = if runs > 1 {
            format!(" run{}", run + 1)
        } else {
            String::new()
        };
        rows.extend(passes(engines, routers, seeds, run, &tag).await);
    }
    if runs > 1 {
        report::print_over_runs(&rows, runs, engines.name());
    }
    rows
}

/// Every router's passes in front of `engines`, and its table.
async fn passes(
    engines: &Engines<'_>,
    routers: &[Router],
    seeds: &[u64],
    run: usize,
    tag: &str,
) -> Vec<report::Row> {
    let mut rows = Vec::new();
    for &router in routers {
        let name = format!("{}, {}", router.name(), engines.name());
        let mut passes = Vec::new();
        for &seed in seeds {
            match run::pass(engines, router, seed, tag).await {
                Ok(pass) => {
                    println!("{}", report::line(&name, seed, &pass));
                    passes.push(pass);
                }
                Err(e) => println!("{name}: skipped ({e})"),
            }
        }
        if !passes.is_empty() {
            rows.push(report::Row::new(name, run, passes));
        }
    }
    println!("\n{} engines:", engines.name());
    report::print_table(&rows);
    rows
}
