//! The time series: every few seconds, prefixlb's resident memory and open descriptors (its
//! newest process, and summed over every live one), what it holds in flight, and how the load
//! fares.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::common::peers::{cpu_time, rss};
use crate::common::percentile;
use crate::fds::{fds, Fds};
use crate::lb::Lb;
use crate::load::Counters;

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub t_s: f64,
    /// The newest prefixlb process, and how long it has run.
    pub generation: usize,
    pub age_s: f64,
    /// prefixlb processes alive (two while an old one finishes after an upgrade).
    pub live: usize,
    pub rss_newest_kib: u64,
    pub rss_sum_kib: u64,
    pub fds_newest: usize,
    pub fds_sum: usize,
    /// The newest process's descriptors by kind.
    pub fds: Fds,
    pub cpu_newest_s: f64,
    /// From `/admin/peers` (whichever live process answered); `None` when it did not.
    pub in_flight: Option<u64>,
    pub waiting: Option<u64>,
    pub peers_listed: Option<usize>,
    pub engines_up: usize,
    pub sent: u64,
    pub ok: u64,
    pub failed: u64,
    /// Time to first token of the turns that succeeded since the sample before.
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Taken once the load stopped: not part of any trend.
    pub after_load: bool,
}

/// `/admin/peers`: the total in flight, the queue, and the peers listed.
pub async fn admin_peers(http: &reqwest::Client, admin: SocketAddr) -> Option<serde_json::Value> {
    let r = http
        .get(format!("http://{admin}/admin/peers"))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    r.json().await.ok()
}

pub struct Sampler {
    pub lb: Arc<Mutex<Lb>>,
    pub admin: SocketAddr,
    pub engines_up: Arc<AtomicUsize>,
    pub counters: Arc<Counters>,
    pub epoch: Instant,
    pub load_stopped: Arc<AtomicBool>,
}

impl Sampler {
    pub async fn sample(&self, http: &reqwest::Client) -> Sample {
        let (generation, started, newest, live) = {
            let mut lb = self.lb.lock().unwrap();
            lb.reap();
            let live: Vec<u32> = lb
                .gens
                .iter()
                .filter(|g| g.alive())
                .map(|g| g.pid)
                .collect();
            let newest = lb.newest();
            (newest.index, newest.started_s, newest.pid, live)
        };
        let listing = admin_peers(http, self.admin).await;
        let mut ttft = std::mem::take(&mut *self.counters.ttft_ms.lock().unwrap());
        ttft.sort_by(f64::total_cmp);
        let t_s = self.epoch.elapsed().as_secs_f64();
        let kinds = Fds::of(newest);
        Sample {
            t_s,
            generation,
            age_s: t_s - started,
            live: live.len(),
            rss_newest_kib: rss(newest) / 1024,
            rss_sum_kib: live.iter().map(|p| rss(*p) / 1024).sum(),
            fds_newest: kinds.total,
            fds_sum: live.iter().map(|p| fds(*p)).sum(),
            fds: kinds,
            cpu_newest_s: cpu_time(newest).as_secs_f64(),
            in_flight: listing.as_ref().and_then(|l| l["in_flight"].as_u64()),
            waiting: listing.as_ref().and_then(|l| l["waiting"].as_u64()),
            peers_listed: listing
                .as_ref()
                .and_then(|l| l["peers"].as_array().map(Vec::len)),
            engines_up: self.engines_up.load(Ordering::SeqCst),
            sent: self.counters.sent.load(Ordering::Relaxed),
            ok: self.counters.ok.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
            ttft_p50_ms: percentile(&ttft, 50.0),
            ttft_p99_ms: percentile(&ttft, 99.0),
            after_load: self.load_stopped.load(Ordering::SeqCst),
        }
    }

    /// Samples every `every` until `stop`, printing a line each time.
    pub async fn run(self, every: Duration, stop: Arc<AtomicBool>) -> Vec<Sample> {
        let http = reqwest::Client::new();
        let mut samples = Vec::new();
        let mut next = Instant::now();
        while !stop.load(Ordering::SeqCst) {
            let s = self.sample(&http).await;
            println!("{}", line(&s));
            samples.push(s);
            next += every;
            while !stop.load(Ordering::SeqCst) && Instant::now() < next {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        samples
    }
}

pub fn line(s: &Sample) -> String {
    let opt = |v: Option<u64>| v.map_or("?".into(), |v| v.to_string());
    format!(
        "{:>7.1}s gen {} ({} live) rss {:.1} MiB (sum {:.1}) fds {} (sum {}; tcp {} + {} close-wait, {} held) in flight {} waiting {} engines {} ok {} failed {} ttft p50 {:.0} ms",
        s.t_s,
        s.generation,
        s.live,
        s.rss_newest_kib as f64 / 1024.0,
        s.rss_sum_kib as f64 / 1024.0,
        s.fds_newest,
        s.fds_sum,
        s.fds.tcp_established,
        s.fds.tcp_close_wait,
        s.fds.held(),
        opt(s.in_flight),
        opt(s.waiting),
        s.engines_up,
        s.ok,
        s.failed,
        s.ttft_p50_ms,
    )
}
