//! After the load: the drain (every slot released, every old process gone), what is left in
//! flight by each account of it, and prefixlb's own records (access and error logs).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::fds::Connections;
use crate::lb::{log_problems, Lb};
use crate::sampler::admin_peers;

#[derive(Debug, Clone, Serialize)]
pub struct End {
    /// From the clients' stop until idle and alone, or the whole drain when never.
    pub drained_after_s: f64,
    /// `/admin/peers` at the end: the total and each peer's in flight, and the queue.
    pub in_flight: Option<u64>,
    pub peers_in_flight: Vec<(String, u64)>,
    pub waiting: Option<u64>,
    /// The sum of `prefixlb_peer_in_flight` on `/metrics`.
    pub metrics_in_flight: Option<f64>,
    /// Each engine's `vllm:num_requests_running`: streams the engines still generate.
    pub engines_running: Vec<(String, Option<f64>)>,
    /// Old generations still running.
    pub old_alive: Vec<usize>,
    /// The connections the newest process still holds once idle for longer than prefixlb's
    /// upstream idle timeout: its health checks' and metric scrapes', and the bench's own
    /// admin reads; clients' are all closed by then.
    pub idle_connections: Connections,
}

/// prefixlb closes pooled upstream connections idle this long (`upstream.idle_timeout_ms`),
/// and a little more.
const IDLE_SETTLE: Duration = Duration::from_secs(6);

impl End {
    pub fn idle(&self) -> bool {
        self.in_flight == Some(0)
            && self.waiting == Some(0)
            && self.peers_in_flight.iter().all(|(_, n)| *n == 0)
            && self.metrics_in_flight == Some(0.0)
            && self.engines_running.iter().all(|(_, n)| *n == Some(0.0))
    }
}

async fn get(http: &reqwest::Client, url: String) -> Option<String> {
    let r = http
        .get(url)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    r.text().await.ok()
}

/// Waits at most `limit` for prefixlb to hold nothing and its old processes to leave, then
/// reads what is left.
pub async fn drain(
    lb: &Arc<Mutex<Lb>>,
    admin: SocketAddr,
    engines: &[SocketAddr],
    limit: Duration,
) -> End {
    let http = reqwest::Client::new();
    let start = Instant::now();
    let old_alive = || {
        let mut lb = lb.lock().unwrap();
        lb.reap();
        let newest = lb.newest().index;
        lb.gens
            .iter()
            .filter(|g| g.alive() && g.index != newest)
            .map(|g| g.index)
            .collect::<Vec<_>>()
    };
    let mut listing = None;
    loop {
        listing = admin_peers(&http, admin).await.or(listing);
        let idle = listing.as_ref().is_some_and(|l: &Value| {
            l["in_flight"] == 0
                && l["waiting"] == 0
                && l["peers"]
                    .as_array()
                    .is_some_and(|ps| ps.iter().all(|p| p["in_flight"] == 0))
        });
        if (idle && old_alive().is_empty()) || start.elapsed() > limit {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drained_after_s = start.elapsed().as_secs_f64();
    let metrics = get(&http, format!("http://{admin}/metrics")).await;
    let metrics_in_flight = metrics.map(|m| {
        m.lines()
            .filter(|l| l.starts_with("prefixlb_peer_in_flight{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    });
    let mut engines_running = Vec::new();
    for e in engines {
        let page = get(&http, format!("http://{e}/metrics")).await;
        let running = page.map(|p| crate::common::sample(&p, "vllm:num_requests_running"));
        engines_running.push((e.to_string(), running));
    }
    let listing = listing.unwrap_or(Value::Null);
    tokio::time::sleep(IDLE_SETTLE).await;
    let idle_connections = {
        let lb = lb.lock().unwrap();
        let ports: Vec<u16> = engines.iter().map(SocketAddr::port).collect();
        Connections::of(lb.newest().pid, lb.addr.port(), admin.port(), &ports)
    };
    End {
        drained_after_s,
        in_flight: listing["in_flight"].as_u64(),
        peers_in_flight: listing["peers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| Some((p["address"].as_str()?.to_owned(), p["in_flight"].as_u64()?)))
            .collect(),
        waiting: listing["waiting"].as_u64(),
        metrics_in_flight,
        engines_running,
        old_alive: old_alive(),
        idle_connections,
    }
}

/// What prefixlb's access logs hold, every generation's together.
#[derive(Debug, Default, Clone, Serialize)]
pub struct AccessLogs {
    pub lines: usize,
    pub by_status: BTreeMap<u16, usize>,
    /// Lines naming an error.
    pub with_error: usize,
    /// Lines of requests no client saw fail, that name an error or a status other than 200.
    pub unexplained: Vec<String>,
}

/// Reads every generation's access log: the counts, and for each of `failed` (request ids)
/// what prefixlb wrote of it.
pub fn access_logs(lb: &Lb, failed: &HashSet<String>) -> (AccessLogs, HashMap<String, Logged>) {
    let mut logs = AccessLogs::default();
    let mut of_failed = HashMap::new();
    for g in &lb.gens {
        for line in lb.access_log(g.index).lines() {
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                continue;
            };
            logs.lines += 1;
            let status = v["status"].as_u64().unwrap_or(0) as u16;
            *logs.by_status.entry(status).or_default() += 1;
            let error = v["error"].as_str().map(str::to_owned);
            logs.with_error += usize::from(error.is_some());
            let id = v["request_id"].as_str().unwrap_or_default();
            if failed.contains(id) {
                of_failed.insert(
                    id.to_owned(),
                    Logged {
                        generation: g.index,
                        status,
                        peer: v["peer"].as_str().map(str::to_owned),
                        error,
                        duration_ms: v["duration_ms"].as_u64().unwrap_or(0),
                    },
                );
            } else if (error.is_some() || status != 200) && logs.unexplained.len() < 50 {
                logs.unexplained.push(format!("gen {}: {line}", g.index));
            }
        }
    }
    (logs, of_failed)
}

#[derive(Debug, Clone, Serialize)]
pub struct Logged {
    pub generation: usize,
    pub status: u16,
    pub peer: Option<String>,
    pub error: Option<String>,
    pub duration_ms: u64,
}

impl std::fmt::Display for Logged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "gen {}: status {}, peer {}, {} ms, error {}",
            self.generation,
            self.status,
            self.peer.as_deref().unwrap_or("-"),
            self.duration_ms,
            self.error.as_deref().unwrap_or("-")
        )
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct LogProblem {
    pub generation: usize,
    pub count: usize,
    pub message: String,
}

/// The warnings and errors of every generation's log.
pub fn log_lines(lb: &Lb) -> Vec<LogProblem> {
    lb.gens
        .iter()
        .flat_map(|g| {
            log_problems(&lb.log(g.index))
                .into_iter()
                .map(|(message, count)| LogProblem {
                    generation: g.index,
                    count,
                    message,
                })
        })
        .collect()
}
