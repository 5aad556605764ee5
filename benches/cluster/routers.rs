//! The routers compared, and how each is set up in front of the GPUs.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::common::peers::{
    start_haproxy, start_haproxy_with, start_sglang_router, start_smg, start_vllm_router,
};
use crate::common::*;
use crate::setup::{ENGINE_LOADS, MAX_IN_FLIGHT, MAX_RUNNING, REPLICAS, SESSION_HEADER};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Router {
    Prefixlb {
        policy: &'static str,
        replicas: usize,
        header: bool,
        /// `routing.shared_prefix_placement: true` (the default is `auto`).
        placement: bool,
        /// Whether the replicas tell each other where prompts went (`replicas:`).
        exchange: bool,
    },
    Vllm(&'static str),
    Sglang(&'static str),
    Smg {
        policy: &'static str,
        /// Sessions kept on their worker by the session header (`--routing-key-override`).
        sticky: bool,
    },
    Haproxy(&'static str),
    /// HAProxy's consistent hashing of the session header, bounded to 1.25 of the mean load.
    HaproxyBounded,
}

pub const ROUTERS: [Router; 15] = [
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
        header: false,
        placement: true,
        exchange: false,
    },
    Router::Prefixlb {
        policy: "least_cost",
        replicas: 1,
        header: true,
        placement: false,
        exchange: false,
    },
    Router::Prefixlb {
        policy: "least_cost",
        replicas: REPLICAS,
        header: false,
        placement: false,
        exchange: true,
    },
    Router::Prefixlb {
        policy: "least_cost",
        replicas: REPLICAS,
        header: false,
        placement: false,
        exchange: false,
    },
    Router::Prefixlb {
        policy: "bounded_consistent_hash",
        replicas: 1,
        header: false,
        placement: false,
        exchange: false,
    },
    Router::Vllm("sticky_least_loaded"),
    Router::Vllm("consistent_hash"),
    Router::Sglang("cache_aware"),
    Router::Smg {
        policy: "cache_aware",
        sticky: false,
    },
    Router::Smg {
        policy: "prefix_hash",
        sticky: false,
    },
    Router::Smg {
        policy: "cache_aware",
        sticky: true,
    },
    Router::Haproxy("roundrobin"),
    Router::Haproxy("leastconn"),
    Router::HaproxyBounded,
];

/// `BENCH_PREFIXLB_ADVANCED=key=value,...`, `BENCH_PREFIXLB_ROUTING=...` and
/// `BENCH_PREFIXLB_ENGINE_METRICS=...`: keys of prefixlb's `advanced:`, `routing:` and
/// `engine_metrics:` sections (values in YAML), set on every prefixlb row
/// and named in it, for a sweep or for measuring what one part brings. A diagnostic may tell
/// prefixlb what it should learn (`routing.prefill_tokens_per_second`). Nothing stops a
/// verdict run from being given some, but its row names then say so.
fn settings() -> Vec<(&'static str, String)> {
    [
        ("advanced", "BENCH_PREFIXLB_ADVANCED"),
        ("routing", "BENCH_PREFIXLB_ROUTING"),
        ("engine_metrics", "BENCH_PREFIXLB_ENGINE_METRICS"),
    ]
    .into_iter()
    .flat_map(|(section, var)| {
        let list = std::env::var(var).unwrap_or_default();
        list.split(',')
            .filter(|s| !s.is_empty())
            .map(|s| (section, s.to_owned()))
            .collect::<Vec<_>>()
    })
    .collect()
}

impl Router {
    pub fn name(self) -> String {
        match self {
            Router::Prefixlb {
                policy,
                replicas,
                header,
                placement,
                exchange,
            } => {
                let key = if header { ", session header" } else { "" };
                let key = if placement {
                    format!("{key}, shared-prefix placement")
                } else {
                    key.to_owned()
                };
                let n = match (replicas, exchange) {
                    (1, _) => String::new(),
                    (n, true) => format!(" ×{n}"),
                    (n, false) => format!(" ×{n} apart"),
                };
                // The advanced keys bare, as the docs' earlier rows name them.
                let tuned: Vec<String> = settings()
                    .into_iter()
                    .map(|(section, s)| match section {
                        "advanced" => s,
                        _ => format!("{section}.{s}"),
                    })
                    .collect();
                let tuned = if tuned.is_empty() {
                    String::new()
                } else {
                    format!(" [{}]", tuned.join(","))
                };
                format!("prefixlb {policy}{n}{key}{tuned}")
            }
            Router::Vllm(p) => format!("vllm-router {p}, session header"),
            Router::Sglang(p) => format!("sglang-router {p}"),
            Router::Smg { policy, sticky } => {
                let sticky = if sticky {
                    ", sticky session header"
                } else {
                    ""
                };
                format!("smg {policy}{sticky}")
            }
            Router::Haproxy(b) => format!("haproxy {b}"),
            Router::HaproxyBounded => "haproxy bounded hash, session header".to_owned(),
        }
    }

    pub fn is_peer(self) -> bool {
        !matches!(self, Router::Prefixlb { .. })
    }

    pub fn sends_header(self) -> bool {
        match self {
            Router::Prefixlb { header, .. } => header,
            // Its sticky policies key on the header; without one, chat requests all hash alike.
            Router::Vllm(_) | Router::HaproxyBounded => true,
            Router::Smg { sticky, .. } => sticky,
            Router::Sglang(_) | Router::Haproxy(_) => false,
        }
    }

    /// Starts the router in front of `gpus`: where clients send, and what keeps it running.
    pub async fn start(self, gpus: &[SocketAddr]) -> Result<(Vec<SocketAddr>, Running), String> {
        match self {
            Router::Prefixlb {
                policy,
                replicas,
                placement,
                exchange,
                ..
            } => {
                let mut config = TestConfig::new()
                    .peers_at(gpus.iter().copied())
                    .max_in_flight(MAX_IN_FLIGHT)
                    .policy(policy)
                    .no_health_check()
                    .engine_metrics(true);
                if placement {
                    config = config.shared_prefix_placement(true);
                }
                for (section, setting) in settings() {
                    let (key, value) = setting.split_once('=').expect(
                        "BENCH_PREFIXLB_ADVANCED, _ROUTING and _ENGINE_METRICS are key=value,...",
                    );
                    config = config.yaml(&[section, key], value);
                }
                let told = if exchange {
                    crate::common::replicas(replicas)
                        .into_iter()
                        .map(Some)
                        .collect()
                } else {
                    vec![None; replicas]
                };
                let mut proxies = Vec::new();
                for told in told {
                    let config = match told {
                        Some(replica) => config.clone().replica(&replica),
                        None => config.clone(),
                    };
                    // The access log stays on, as by default: its cost is part of what is
                    // measured.
                    proxies.push(start_proxy(&config).await);
                }
                let addrs = proxies.iter().map(|p| p.addr).collect();
                Ok((addrs, Running::Prefixlb(proxies)))
            }
            Router::Vllm(policy) => {
                let (addr, child) = start_vllm_router(gpus, policy).await?;
                Ok((vec![addr], Running::Other(child)))
            }
            Router::Sglang(policy) => {
                let (addr, child) = start_sglang_router(gpus, policy, MAX_RUNNING).await?;
                Ok((vec![addr], Running::Other(child)))
            }
            Router::Smg { policy, sticky } => {
                let header = sticky.then_some(SESSION_HEADER);
                let (addr, child) =
                    start_smg(gpus, policy, MAX_RUNNING, header, ENGINE_LOADS).await?;
                Ok((vec![addr], Running::Other(child)))
            }
            Router::Haproxy(balance) => {
                let (addr, child) = start_haproxy(gpus, balance, false, 4096, "").await?;
                Ok((vec![addr], Running::Other(child)))
            }
            Router::HaproxyBounded => {
                // HAProxy's own answer to sticky-but-balanced (configuration manual,
                // `hash-balance-factor`): a session's requests hash to one server on a
                // consistent ring, and a server already above 125% of the mean load (the
                // manual's example value, 1.25 as in SMG's prefix_hash) passes the request to
                // the next on the ring.
                let backend = format!(
                    "  balance hdr({SESSION_HEADER})\n  hash-type consistent\n  hash-balance-factor 125\n"
                );
                let (addr, child) = start_haproxy_with(gpus, &backend, false, 4096, "").await?;
                Ok((vec![addr], Running::Other(child)))
            }
        }
    }
}

pub enum Running {
    Prefixlb(Vec<Proxy>),
    /// Held only to be stopped when dropped.
    Other(#[allow(dead_code)] crate::common::peers::Killed),
}

impl Running {
    /// prefixlb's access logs once they hold a line for each of the `requests` sent, or as they
    /// are after 2 s: the writer flushes in batches every 20 ms, so the last responses' lines
    /// come a moment after the client has read them.
    pub async fn access_log(&self, requests: usize) -> String {
        let Running::Prefixlb(proxies) = self else {
            return String::new();
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        loop {
            let log: String = proxies.iter().map(Proxy::access_log).collect();
            let lines = log.lines().filter(|l| l.contains(" peer=")).count();
            if lines >= requests {
                return log;
            }
            if tokio::time::Instant::now() >= deadline {
                // Said, so that a count read from it (the turns moved) is not taken as whole.
                println!(
                    "prefixlb's access log has {lines} lines of {requests} requests after 2 s"
                );
                return log;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Keeps prefixlb's standard error as `$BENCH_DEBUG_DIR/NAME.log`, when that is set (with
    /// `PREFIXLB_TEST_LOG` at debug for `least_cost`, every decision's prices).
    pub fn keep_log(&self, name: &str) {
        let (Ok(dir), Running::Prefixlb(proxies)) = (std::env::var("BENCH_DEBUG_DIR"), self) else {
            return;
        };
        let log: String = proxies.iter().map(Proxy::log).collect();
        let file: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = std::path::Path::new(&dir).join(format!("{file}.log"));
        if let Err(e) = std::fs::write(&path, log) {
            println!("could not keep prefixlb's log as {}: {e}", path.display());
        }
    }

    /// The lines of prefixlb's `/metrics` whose series is `name`, from every process.
    pub async fn series(&self, name: &str) -> Vec<String> {
        let mut lines = Vec::new();
        if let Running::Prefixlb(proxies) = self {
            for p in proxies {
                let page = p.metrics().await;
                let of = |l: &&str| {
                    l.strip_prefix(name)
                        .is_some_and(|r| r.starts_with(['{', ' ']))
                };
                lines.extend(page.lines().filter(of).map(str::to_owned));
            }
        }
        lines
    }

    /// How prefixlb chose its peers, summed over its processes: requests per route.
    pub async fn routes(&self) -> BTreeMap<String, f64> {
        let mut routes = BTreeMap::new();
        for line in self.series("prefixlb_peer_requests_total").await {
            let route = line
                .split("route=\"")
                .nth(1)
                .and_then(|r| r.split('"').next());
            let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            if let (Some(route), Some(value)) = (route, value) {
                *routes.entry(route.to_owned()).or_default() += value;
            }
        }
        routes
    }
}
