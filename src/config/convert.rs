//! From the file to the settings: every value checked on the way, every error naming its field.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
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
    AdminSettings, Auth, Discovery, Dns, DnsQuery, EngineMetrics, ForwardingSettings, HealthCheck,
    Listener, ModelDiscovery, PeekLimits, ProxySettings, Registry, Replicas, RouterSettings,
    Settings, TlsFiles, Upstream, UpstreamTls,
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

/// `host` of `host:port` (an IPv6 address without its brackets).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// A file named in the configuration, as an absolute path (a daemon runs from /), kept as
/// written otherwise: a symlink is followed at each read, as certbot's `live/` links and
/// Kubernetes' secret mounts are renewed by repointing them.
fn existing_file(field: &str, path: &std::path::Path) -> Result<PathBuf, ConfigError> {
    let fail = |e: std::io::Error| ConfigError::new(field, format!("{}: {e}", path.display()));
    std::fs::metadata(path).map_err(fail)?;
    std::path::absolute(path).map_err(fail)
}

fn listener(i: usize, l: &schema::Listen) -> Result<Listener, ConfigError> {
    let field = format!("listen[{i}]");
    Ok(match l {
        schema::Listen::Addr(addr) => Listener {
            addr: socket_addr(&field, addr)?,
            tls: None,
        },
        schema::Listen::Full(full) => Listener {
            addr: socket_addr(&format!("{field}.addr"), &full.addr)?,
            tls: match &full.tls {
                Some(tls) => Some(TlsFiles {
                    cert: existing_file(&format!("{field}.tls.cert"), &tls.cert)?,
                    key: existing_file(&format!("{field}.tls.key"), &tls.key)?,
                }),
                None => None,
            },
        },
    })
}

fn upstream_tls(t: &schema::UpstreamTlsFile) -> Result<UpstreamTls, ConfigError> {
    let field = "upstream.tls.ca_file";
    let ca = match &t.ca_file {
        Some(path) => {
            let pem = std::fs::read(path)
                .map_err(|e| ConfigError::new(field, format!("{}: {e}", path.display())))?;
            Some(crate::tls::ca_bundle(&pem)?)
        }
        None => None,
    };
    Ok(UpstreamTls {
        ca,
        verify: t.verify,
    })
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
        if p.sni.is_some() && !p.tls {
            return Err(ConfigError::new(
                field("sni"),
                "is for peers with tls: true",
            ));
        }
        specs.push(PeerSpec {
            addr,
            weight: weight(&field("weight"), p.weight)?,
            max_in_flight: ceiling(&field("max_in_flight"), p.max_in_flight)?,
            tls: p
                .tls
                .then(|| p.sni.clone().unwrap_or_else(|| host_of(&p.addr).to_owned())),
            models: p.models.clone(),
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
            .map(|(i, l)| listener(i, l))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, l) in listen.iter().enumerate() {
            if listen[..i].iter().any(|other| other.addr == l.addr) {
                return Err(ConfigError::new(
                    format!("listen[{i}]"),
                    format!("{} is listed twice", l.addr),
                ));
            }
        }
        let auth = match &self.auth {
            Some(a) => Some(Auth {
                keys_file: existing_file("auth.keys_file", &a.keys_file)?,
                forward_key: a.forward_key,
            }),
            None => None,
        };
        let peers = peers(&self.peers)?;
        let router = router(&self.routing, &self.outlier)?;
        let proxy = proxy(&self)?;
        Ok(Settings {
            listen,
            h2c: self.h2c,
            auth,
            router,
            proxy,
            admin: admin(self.admin)?,
            allow_empty_peers: self.discovery.allow_empty,
            discovery: discovery(self.discovery, !peers.is_empty())?,
            health_check: health_check(self.health_check)?,
            engine_metrics: engine_metrics(self.engine_metrics)?,
            model_discovery: match self.models.discover {
                true => {
                    let interval = millis("models.interval_ms", self.models.interval_ms)?;
                    Some(ModelDiscovery {
                        interval,
                        timeout: interval.min(Duration::from_secs(2)),
                    })
                }
                false => None,
            },
            replicas: self.replicas.map(replicas).transpose()?,
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

fn replicas(r: schema::ReplicasFile) -> Result<Replicas, ConfigError> {
    if r.others.is_empty() {
        return Err(ConfigError::new(
            "replicas.others",
            "lists no other process (omit replicas for none)",
        ));
    }
    Ok(Replicas {
        listen: socket_addr("replicas.listen", &r.listen)?,
        others: r
            .others
            .iter()
            .enumerate()
            .map(|(i, o)| socket_addr(&format!("replicas.others[{i}]"), o))
            .collect::<Result<_, _>>()?,
    })
}

/// The record's largest budget: 4 GiB, millions of prompts' worth.
const MAX_RECORD_MIB: usize = 4096;

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
    if !(1..=MAX_RECORD_MIB).contains(&r.prefix_record_mib) {
        return Err(ConfigError::new(
            "routing.prefix_record_mib",
            format!("must be from 1 to {MAX_RECORD_MIB}"),
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
                ..CostModel::DEFAULT
            },
        },
        ring: RingConfig {
            vnodes_per_weight: r.vnodes_per_weight,
        },
        record_bytes: r.prefix_record_mib << 20,
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
    if f.models.default.as_deref() == Some("") {
        return Err(ConfigError::new(
            "models.default",
            "must not be empty (omit it for none)",
        ));
    }
    Ok(ProxySettings {
        default_model: f.models.default.clone(),
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
            tls: upstream_tls(&u.tls)?,
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
    let sources = [d.peers_file.is_some(), d.dns.is_some(), d.redis.is_some()];
    if sources.iter().any(|&s| s) && has_peers {
        return Err(ConfigError::new(
            "peers",
            "must be empty when discovery.peers_file, dns or redis gives the peers",
        ));
    }
    if sources.iter().filter(|&&s| s).count() > 1 {
        return Err(ConfigError::new(
            "discovery",
            "peers_file, dns and redis are separate sources: choose one",
        ));
    }
    let interval = millis("discovery.reload_interval_ms", d.reload_interval_ms)?;
    if let Some(redis) = d.redis {
        return Ok(Discovery::Redis(Registry {
            url: redis.url,
            prefix: redis.prefix,
            interval: millis("discovery.redis.interval_ms", redis.interval_ms)?,
        }));
    }
    Ok(match (d.peers_file, d.dns) {
        // Both at once were refused above.
        (Some(path), _) => Discovery::PeersFile { path, interval },
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
            tls: match (dns.tls, dns.sni) {
                (true, sni) => Some(sni.unwrap_or_else(|| dns.name.clone())),
                (false, None) => None,
                (false, Some(_)) => {
                    return Err(ConfigError::new(
                        "discovery.dns.sni",
                        "is for peers with tls: true",
                    ))
                }
            },
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
