//! The soak (issue 32): one real prefixlb process in front of four gpu-sim engines, each its
//! own OS process, under steady streamed load for 30 minutes, while engines are killed and
//! restarted (every 4 minutes), the peers file is rewritten (every 3: an engine left out and
//! listed again, a weight raised and set back) and prefixlb is upgraded in place (every 10).
//!
//! `cargo bench --bench soak`; `SOAK_MINUTES=3` for a short run, every interval shrunk in
//! proportion. Every few seconds it samples the newest prefixlb process's resident memory
//! and open descriptors (and their sums over every live process, in the CSV), and what
//! `/admin/peers` holds in flight. At the end, after a drain, it checks that memory and
//! descriptors stayed flat in each process once warm, that nothing is left in flight (by
//! prefixlb's admin API, its metrics and the engines' own count), that every upgrade took
//! over and every old process left, and that no request was lost: a request counts as cut by
//! a kill when it failed while its engine (from gpu-sim's `x-upstream` header or prefixlb's
//! access log) was down, and as lost otherwise. Writes `soak.csv`, `soak.json` and `soak.md`
//! to `target/bench-results` (or `$BENCH_OUT`), prints the summary, and exits non-zero when
//! a check fails.

mod checks;
#[path = "../common/mod.rs"]
mod common;
mod disturb;
mod end;
mod engines;
mod fds;
mod lb;
mod load;
mod plan;
mod report;
mod sampler;
mod verdict;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use disturb::Disturber;
use plan::{Event, Plan};
use report::{GenInfo, Summary};
use verdict::{classify, flat_check, segments};

const CLIENTS: usize = 24;
const ENGINES: usize = 4;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let plan = match Plan::from_env() {
        Ok(plan) => plan,
        Err(e) => {
            eprintln!("soak: {e}");
            std::process::exit(2);
        }
    };
    match run(plan).await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("soak: {e}");
            std::process::exit(2);
        }
    }
}

async fn run(plan: Plan) -> Result<bool, String> {
    let out = common::out_dir();
    // Kept after the run: prefixlb's and the engines' logs are where a failure is explained.
    let dir = out.join("soak-run");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let engines = engines::Engines::start(ENGINES, &dir).await?;
    let engine_addrs = engines.addrs.clone();
    let epoch = Instant::now();
    let all: Vec<(String, u32)> = engine_addrs.iter().map(|a| (a.to_string(), 1)).collect();
    let lb = lb::Lb::start(&dir, &all, epoch).await?;
    let (addr, admin) = (lb.addr, lb.admin);
    let lb = Arc::new(Mutex::new(lb));
    let mut disturber = Disturber::new(engines, Arc::clone(&lb), admin, epoch, plan.restart_after);

    let schedule = plan.schedule();
    println!(
        "soak: {:.1} min, {CLIENTS} clients, {ENGINES} engines {engine_addrs:?}, prefixlb on {addr} (admin {admin}), files in {}",
        plan.total.as_secs_f64() / 60.0,
        dir.display()
    );
    for (at, event) in &schedule {
        println!("  planned at {:>6.1} s: {event:?}", at.as_secs_f64());
    }

    let load = load::Load::start(CLIENTS, format!("http://{addr}/v1/chat/completions"), epoch);
    let counters = Arc::clone(&load.counters);
    let stop_sampling = Arc::new(AtomicBool::new(false));
    let load_stopped = Arc::new(AtomicBool::new(false));
    let sampler = sampler::Sampler {
        lb: Arc::clone(&lb),
        admin,
        engines_up: Arc::clone(&disturber.engines_up),
        counters: Arc::clone(&counters),
        epoch,
        load_stopped: Arc::clone(&load_stopped),
    };
    let sampling = tokio::spawn(sampler.run(plan.sample_every, Arc::clone(&stop_sampling)));
    // Old processes' exits to the tenth of a second: how long one lingers is a result.
    let reaper = {
        let (lb, stop) = (Arc::clone(&lb), Arc::clone(&stop_sampling));
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                lb.lock().unwrap().reap();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    for (at, event) in schedule {
        tokio::time::sleep_until((epoch + at).into()).await;
        match event {
            Event::Kill => disturber.kill().await,
            Event::Peers => disturber.change_peers().await,
            Event::Upgrade => disturber.upgrade().await,
        }
    }
    tokio::time::sleep_until((epoch + plan.total).into()).await;
    println!("stopping the load");
    load_stopped.store(true, Ordering::SeqCst);
    let failures = load.stop().await;
    let load_ended_s = epoch.elapsed().as_secs_f64();
    let end = end::drain(&lb, admin, &engine_addrs, plan.drain).await;
    stop_sampling.store(true, Ordering::SeqCst);
    let _ = reaper.await;
    let mut samples = sampling.await.map_err(|e| e.to_string())?;
    // One more after the drain: the level the last process settles at once idle.
    let last = sampler::Sampler {
        lb: Arc::clone(&lb),
        admin,
        engines_up: Arc::clone(&disturber.engines_up),
        counters,
        epoch,
        load_stopped,
    };
    let idle = last.sample(&reqwest::Client::new()).await;
    println!("{}", sampler::line(&idle));
    samples.push(idle);

    let failed_ids: HashSet<String> = failures.iter().map(|f| f.request_id.clone()).collect();
    let (access_logs, logged, log_problems, generations) = {
        let lb = lb.lock().unwrap();
        let (access, logged) = end::access_logs(&lb, &failed_ids);
        let generations: Vec<GenInfo> = lb
            .gens
            .iter()
            .map(|g| GenInfo {
                index: g.index,
                pid: g.pid,
                started_s: g.started_s,
                quit_s: g.quit_s,
                exit: g.exited.clone(),
            })
            .collect();
        (access, logged, end::log_lines(&lb), generations)
    };
    let mut classified: Vec<_> = failures
        .into_iter()
        .map(|mut f| {
            let line = logged.get(&f.request_id);
            if f.engine.is_none() {
                f.engine = line.and_then(|l| l.peer.clone());
            }
            classify(f, &disturber.timeline, line.map(ToString::to_string))
        })
        .collect();
    classified.sort_by(|a, b| a.failure.failed_s.total_cmp(&b.failure.failed_s));
    let cut_by_kill = classified
        .iter()
        .filter(|c| c.cut_by_kill.is_some())
        .count();
    let segs = segments(&samples, plan.warm_up.as_secs_f64());
    let checks = vec![
        flat_check("RSS flat after warm-up", "MiB", &segs, |s| &s.rss),
        flat_check(
            "open fds flat after warm-up (all but TCP connections)",
            "fds",
            &segs,
            |s| &s.fds_held,
        ),
        checks::connections(&end, ENGINES),
        checks::in_flight(&end),
        checks::lost(&classified, &disturber.timeline),
        checks::disturbances(&disturber.timeline, &generations, &end),
    ];
    let pass = checks.iter().all(|c| c.pass);
    let sent = load_counts(&samples);
    let summary = Summary {
        minutes: plan.total.as_secs_f64() / 60.0,
        clients: CLIENTS,
        engines: ENGINES,
        plan: vec![
            ("kill every", plan.kill_every.as_secs_f64()),
            ("restart after", plan.restart_after.as_secs_f64()),
            ("peers file every", plan.rewrite_every.as_secs_f64()),
            ("upgrade every", plan.upgrade_every.as_secs_f64()),
            ("sample every", plan.sample_every.as_secs_f64()),
            ("warm-up", plan.warm_up.as_secs_f64()),
        ],
        sent: sent.0,
        ok: sent.1,
        failed: classified.len(),
        cut_by_kill,
        lost: classified.len() - cut_by_kill,
        load_ended_s,
        generations,
        timeline: disturber.timeline.clone(),
        segments: segs,
        end,
        checks,
        pass,
        failures: classified,
        access_logs,
        log_problems,
        run_dir: dir,
    };
    let paths = report::write(&out, &summary, &samples)?;
    println!("\n{}", report::markdown(&summary, 20));
    for p in paths {
        println!("wrote {}", p.display());
    }
    Ok(pass)
}

/// Requests sent and answered whole, as the last sample counted them.
fn load_counts(samples: &[sampler::Sample]) -> (u64, u64) {
    samples.last().map_or((0, 0), |s| (s.sent, s.ok))
}
