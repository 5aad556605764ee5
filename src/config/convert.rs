//! From the file to the settings: every value checked on the way, every error naming its field.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use http::HeaderName;

use super::error::ConfigError;
use super::schema::{self, DnsRecord, File};
use crate::routing::cost::{CostModel, MAX_CANDIDATES};
use crate::routing::{
    Balance, KeyConfig, KeySource, OutlierPolicy, PeerSpec, QueueLimit, RingConfig, Weight,
    MAX_WEIGHT, UNLIMITED,
};
use crate::settings::{
    AdminSettings, Discovery, Dns, DnsQuery, EngineMetrics, ForwardingSettings, HealthCheck,
    PeekLimits, ProxySettings, RouterSettings, Settings, Upstream,
};

fn at_least_one(field: &str, n: u64) -> Result<(), ConfigError> {
    if n == 0 {
        return Err(ConfigError::new(field, "must be at least 1"));
    }
    Ok(())
}

fn millis(field: &str, ms: u64) -> Result<Duration, ConfigError> {
    at_least_one(field, ms)?;
    Ok(Duration::from_millis(ms))
}

fn socket_addr(field: &str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse()
        .map_err(|e| ConfigError::new(field, format!("`{text}` is not ip:port ({e})")))
}

fn weight(field: &str, w: u32) -> Result<Weight, ConfigError> {
    Weight::new(w).ok_or_else(|| ConfigError::new(field, format!("must be from 1 to {MAX_WEIGHT}")))
}

/// `None` is no ceiling; 0 is refused rather than read as "nothing may run".
fn ceiling(field: &str, max: Option<u32>) -> Result<u32, ConfigError> {
    match max {
        Some(0) => Err(ConfigError::new(
            field,
            "must be at least 1 (omit it for no ceiling)",
        )),
        Some(n) => Ok(n),
        None => Ok(UNLIMITED),
    }
}

fn path(field: &str, p: &str) -> Result<(), ConfigError> {
    if !p.starts_with('/') {
        return Err(ConfigError::new(field, format!("`{p}` must start with /")));
    }
    Ok(())
}

/// The peers as the routing core takes them; hostnames are resolved here, once.
pub fn peers(peers: &[schema::Peer]) -> Result<Vec<PeerSpec>, ConfigError> {
    let mut specs: Vec<PeerSpec> = Vec::with_capacity(peers.len());
    for (i, p) in peers.iter().enumerate() {
        let field = |name: &str| format!("peers[{i}].{name}");
        let addr = p
            .addr
            .to_socket_addrs()
            .map_err(|e| ConfigError::new(field("addr"), format!("`{}`: {e}", p.addr)))?
            .next()
            .ok_or_else(|| {
                ConfigError::new(field("addr"), format!("`{}` resolves to nothing", p.addr))
            })?;
        if specs.iter().any(|s| s.addr == addr) {
            return Err(ConfigError::new(
                field("addr"),
                format!("{addr} is listed twice"),
            ));
        }
        specs.push(PeerSpec {
            addr,
            weight: weight(&field("weight"), p.weight)?,
            max_in_flight: ceiling(&field("max_in_flight"), p.max_in_flight)?,
        });
    }
    Ok(specs)
}

impl File {
    pub fn into_settings(self) -> Result<Settings, ConfigError> {
        if self.listen.is_empty() {
            return Err(ConfigError::new("listen", "at least one address is needed"));
        }
        let listen = self
            .listen
            .iter()
            .enumerate()
            .map(|(i, l)| socket_addr(&format!("listen[{i}]"), l))
            .collect::<Result<_, _>>()?;
        let peers = peers(&self.peers)?;
        let router = router(&self.routing, &self.outlier)?;
        let proxy = proxy(&self)?;
        Ok(Settings {
            listen,
            router,
            proxy,
            admin: admin(self.admin)?,
            allow_empty_peers: self.discovery.allow_empty,
            discovery: discovery(self.discovery, !peers.is_empty())?,
            health_check: health_check(self.health_check)?,
            engine_metrics: engine_metrics(self.engine_metrics)?,
            peers,
        })
    }
}

fn admin(a: schema::Admin) -> Result<Option<AdminSettings>, ConfigError> {
    let Some(listen) = a.listen else {
        return Ok(None);
    };
    if a.token.as_deref() == Some("") {
        return Err(ConfigError::new(
            "admin.token",
            "must not be empty (omit it for none)",
        ));
    }
    let listen = socket_addr("admin.listen", &listen)?;
    if !listen.ip().is_loopback() && a.token.is_none() {
        return Err(ConfigError::new(
            "admin.listen",
            format!("{listen} is not loopback: set admin.token, since the admin API can drain every peer"),
        ));
    }
    Ok(Some(AdminSettings {
        listen,
        token: a.token,
    }))
}

fn router(r: &schema::Routing, o: &schema::Outlier) -> Result<RouterSettings, ConfigError> {
    if let Some(c) = r.balance_factor {
        if !(c.is_finite() && c >= 1.0) {
            return Err(ConfigError::new(
                "routing.balance_factor",
                format!("must be a number ≥ 1 (or null for none), not {c}"),
            ));
        }
    }
    at_least_one("routing.vnodes_per_weight", r.vnodes_per_weight.into())?;
    let rate = r.prefill_tokens_per_second;
    if !(rate.is_finite() && rate >= 1.0) {
        return Err(ConfigError::new(
            "routing.prefill_tokens_per_second",
            format!("must be a number ≥ 1, not {rate}"),
        ));
    }
    if !(1..=MAX_CANDIDATES).contains(&r.candidates) {
        return Err(ConfigError::new(
            "routing.candidates",
            format!("must be from 1 to {MAX_CANDIDATES}"),
        ));
    }
    let base_ejection = millis("outlier.base_ejection_ms", o.base_ejection_ms)?;
    if o.max_ejection_ms < o.base_ejection_ms {
        return Err(ConfigError::new(
            "outlier.max_ejection_ms",
            "must be at least base_ejection_ms",
        ));
    }
    Ok(RouterSettings {
        keys: keys(&r.key)?,
        balance: Balance {
            policy: r.policy,
            balance_factor: r.balance_factor,
            cost: CostModel {
                prefill_tokens_per_sec: rate,
                candidates: r.candidates,
                shared_prefix_placement: r.shared_prefix_placement,
            },
        },
        ring: RingConfig {
            vnodes_per_weight: r.vnodes_per_weight,
        },
        outlier: OutlierPolicy {
            consecutive_failures: o.consecutive_failures,
            base_ejection,
            max_ejection: Duration::from_millis(o.max_ejection_ms),
            max_ejected_percent: match o.max_ejected_percent {
                p @ 0..=100 => p,
                _ => {
                    return Err(ConfigError::new(
                        "outlier.max_ejected_percent",
                        "must be from 0 to 100",
                    ))
                }
            },
        },
    })
}

fn keys(k: &schema::Key) -> Result<KeyConfig, ConfigError> {
    at_least_one("routing.key.prefix_chars", k.prefix_chars as u64)?;
    for (i, s) in k.sources.iter().enumerate() {
        if matches!(s, KeySource::ClientAddr | KeySource::None) {
            return Err(ConfigError::new(
                format!("routing.key.sources[{i}]"),
                "is a fallback, not a source: set routing.key.fallback",
            ));
        }
    }
    let session_header = HeaderName::from_bytes(k.session_header.as_bytes()).map_err(|_| {
        ConfigError::new(
            "routing.key.session_header",
            format!("`{}` is not a valid header name", k.session_header),
        )
    })?;
    let on = |source: KeySource, field: &str, p: &str| -> Result<Option<String>, ConfigError> {
        path(&format!("routing.key.{field}"), p)?;
        Ok(k.sources.contains(&source).then(|| p.to_owned()))
    };
    Ok(KeyConfig {
        session_header: k
            .sources
            .contains(&KeySource::SessionHeader)
            .then_some(session_header),
        chat_path: on(KeySource::Chat, "chat_path", &k.chat_path)?,
        completions_path: on(
            KeySource::Completions,
            "completions_path",
            &k.completions_path,
        )?,
        generate_path: on(KeySource::Generate, "generate_path", &k.generate_path)?,
        prefix_chars: k.prefix_chars,
        fallback: k.fallback,
    })
}

fn proxy(f: &File) -> Result<ProxySettings, ConfigError> {
    at_least_one(
        "routing.peek_limit_bytes",
        f.routing.peek_limit_bytes as u64,
    )?;
    at_least_one("limits.max_body_bytes", f.limits.max_body_bytes as u64)?;
    if f.limits.peek_memory_bytes < f.routing.peek_limit_bytes.saturating_mul(2) {
        return Err(ConfigError::new(
            "limits.peek_memory_bytes",
            format!(
                "must be at least twice routing.peek_limit_bytes ({}): one peek holds its window and Pingora's copy of it",
                f.routing.peek_limit_bytes.saturating_mul(2)
            ),
        ));
    }
    let u = &f.upstream;
    let q = &f.queue;
    if q.max_waiting > 0 && q.timeout_ms == 0 {
        return Err(ConfigError::new(
            "queue.timeout_ms",
            "must be at least 1 when max_waiting is above 0",
        ));
    }
    Ok(ProxySettings {
        peek: PeekLimits {
            peek_limit: f.routing.peek_limit_bytes,
            max_body: f.limits.max_body_bytes,
            deadline: millis("routing.peek_timeout_ms", f.routing.peek_timeout_ms)?,
            memory: f.limits.peek_memory_bytes,
        },
        upstream: Upstream {
            connect_timeout: millis("upstream.connect_timeout_ms", u.connect_timeout_ms)?,
            read_timeout: millis("upstream.read_timeout_ms", u.read_timeout_ms)?,
            write_timeout: millis("upstream.write_timeout_ms", u.write_timeout_ms)?,
            idle_timeout: millis("upstream.idle_timeout_ms", u.idle_timeout_ms)?,
            connect_retries: u.connect_retries,
        },
        queue: QueueLimit {
            max_waiting: q.max_waiting,
            timeout: Duration::from_millis(q.timeout_ms),
        },
        access_log: f.access_log,
        access_log_key: f.access_log_key.clone(),
        client_write_timeout: millis(
            "limits.client_write_timeout_ms",
            f.limits.client_write_timeout_ms,
        )?,
        forwarding: forwarding(
            &f.forwarding,
            &[
                &f.routing.key.chat_path,
                &f.routing.key.completions_path,
                &f.routing.key.generate_path,
            ],
        )?,
    })
}

fn forwarding(
    f: &schema::Forwarding,
    key_paths: &[&String],
) -> Result<ForwardingSettings, ConfigError> {
    let trusted_proxies = f
        .trusted_proxies
        .iter()
        .enumerate()
        .map(|(i, net)| {
            net.parse::<ipnet::IpNet>()
                .or_else(|_| net.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| {
                    ConfigError::new(
                        format!("forwarding.trusted_proxies[{i}]"),
                        format!("`{net}` is not an address or a network like 10.0.0.0/8"),
                    )
                })
        })
        .collect::<Result<_, _>>()?;
    let request_id_header = f
        .request_id_header
        .as_deref()
        .map(|h| {
            let name = HeaderName::try_from(h).map_err(|_| {
                ConfigError::new(
                    "forwarding.request_id_header",
                    format!("`{h}` is not a header name"),
                )
            })?;
            // The id replaces whatever the header held: it must not be one HTTP itself reads.
            const FRAMING: &[&str] = &[
                "host",
                "content-length",
                "transfer-encoding",
                "connection",
                "keep-alive",
                "upgrade",
                "te",
                "trailer",
                "expect",
                "proxy-connection",
            ];
            if FRAMING.contains(&name.as_str()) {
                return Err(ConfigError::new(
                    "forwarding.request_id_header",
                    format!("`{h}` is a header HTTP itself reads: name another"),
                ));
            }
            Ok(name)
        })
        .transpose()?;
    let allowed_paths = match &f.allowed_paths {
        Some(paths) => {
            for (i, p) in paths.iter().enumerate() {
                path(&format!("forwarding.allowed_paths[{i}]"), p)?;
            }
            // The paths keys are read from are forwarded, whatever they were renamed to.
            let mut allowed = paths.clone();
            for &p in key_paths {
                if !p.is_empty() && !allowed.contains(p) {
                    allowed.push(p.clone());
                }
            }
            Some(allowed)
        }
        None => None,
    };
    Ok(ForwardingSettings {
        trusted_proxies,
        request_id_header,
        allowed_paths,
    })
}

fn discovery(d: schema::DiscoveryFile, has_peers: bool) -> Result<Discovery, ConfigError> {
    if (d.peers_file.is_some() || d.dns.is_some()) && has_peers {
        return Err(ConfigError::new(
            "peers",
            "must be empty when discovery.peers_file or discovery.dns gives the peers",
        ));
    }
    let interval = millis("discovery.reload_interval_ms", d.reload_interval_ms)?;
    Ok(match (d.peers_file, d.dns) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::new(
                "discovery",
                "peers_file and dns are two sources: choose one",
            ))
        }
        (Some(path), None) => Discovery::PeersFile { path, interval },
        (None, Some(dns)) => Discovery::Dns(Dns {
            query: match (dns.record, dns.port) {
                (DnsRecord::A, Some(port)) => DnsQuery::A { port },
                (DnsRecord::A, None) => {
                    return Err(ConfigError::new(
                        "discovery.dns.port",
                        "is needed with A/AAAA records (SRV records carry their own)",
                    ))
                }
                (DnsRecord::Srv, _) => DnsQuery::Srv,
            },
            interval: millis("discovery.dns.interval_ms", dns.interval_ms)?,
            weight: weight("discovery.dns.weight", dns.weight)?,
            max_in_flight: ceiling("discovery.dns.max_in_flight", dns.max_in_flight)?,
            failures_before_removal: {
                let n = dns.failures_before_removal;
                at_least_one("discovery.dns.failures_before_removal", n.into())?;
                n
            },
            nameserver: dns.nameserver,
            name: dns.name,
        }),
        (None, None) => Discovery::ConfigFile { interval },
    })
}

fn health_check(h: schema::HealthCheck) -> Result<Option<HealthCheck>, ConfigError> {
    path("health_check.path", &h.path)?;
    at_least_one("health_check.healthy_after", h.healthy_after as u64)?;
    at_least_one("health_check.unhealthy_after", h.unhealthy_after as u64)?;
    let check = HealthCheck {
        interval: millis("health_check.interval_ms", h.interval_ms)?,
        timeout: millis("health_check.timeout_ms", h.timeout_ms)?,
        healthy_after: h.healthy_after,
        unhealthy_after: h.unhealthy_after,
        path: h.path,
    };
    Ok(h.enabled.then_some(check))
}

fn engine_metrics(e: schema::EngineMetricsFile) -> Result<Option<EngineMetrics>, ConfigError> {
    path("engine_metrics.path", &e.path)?;
    let metrics = EngineMetrics {
        interval: millis("engine_metrics.interval_ms", e.interval_ms)?,
        timeout: millis("engine_metrics.timeout_ms", e.timeout_ms)?,
        path: e.path,
    };
    Ok(e.enabled.then_some(metrics))
}
