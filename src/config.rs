//! prefixlb's own configuration: one YAML file, read with serde. Pingora's server settings stay
//! in Pingora's file (`-c`).
//!
//! Every error names the field and the reason: unknown keys, wrong types and bad values alike.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderName;
use serde::Deserialize;

use crate::access_log::AccessLogFormat;
use crate::routing::{
    Balance, Fallback, KeyConfig, OutlierPolicy, PeerSpec, Policy, RingConfig,
    DEFAULT_BALANCE_FACTOR, DEFAULT_VNODES_PER_WEIGHT, MAX_WEIGHT, UNLIMITED,
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where in the file, as `section.field` or `peers[2].addr`; empty for the file as a whole.
    pub field: String,
    pub reason: String,
}

impl ConfigError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.reason)
        } else {
            write!(f, "{}: {}", self.field, self.reason)
        }
    }
}

impl std::error::Error for ConfigError {}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Addresses the proxy listens on.
    #[serde(default = "default_listen")]
    pub listen: Vec<String>,
    #[serde(default)]
    pub peers: Vec<PeerConfig>,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub queue: QueueConfig,
    #[serde(default)]
    pub limits: LimitsConfig,
    #[serde(default)]
    pub upstream: UpstreamConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub discovery: DiscoveryConfig,
    #[serde(default)]
    pub health_check: HealthCheckConfig,
    #[serde(default)]
    pub outlier: OutlierConfig,
    /// One line per request on standard output: plain, json or off.
    #[serde(default = "default_access_log")]
    pub access_log: AccessLogFormat,
}

/// Where the peers come from after start: the `peers` section of this file (the default), a
/// peers file, or DNS. Files are re-read when they change and on SIGHUP.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// A YAML file holding `peers: [...]`, in the same form as this file's `peers`.
    #[serde(default)]
    pub peers_file: Option<PathBuf>,
    /// How often a peers file (or this file) is checked for changes.
    #[serde(default = "default_reload_interval")]
    pub reload_interval_ms: u64,
    #[serde(default)]
    pub dns: Option<DnsConfig>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DnsRecord {
    /// A and AAAA records, each address with `port`.
    A,
    /// SRV records: target, port and weight from the record.
    Srv,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsConfig {
    /// e.g. `vllm.inference.svc.cluster.local` (a Kubernetes headless service).
    pub name: String,
    #[serde(default = "default_dns_record")]
    pub record: DnsRecord,
    /// The port of every address (A/AAAA records).
    #[serde(default)]
    pub port: Option<u16>,
    #[serde(default = "default_dns_interval")]
    pub interval_ms: u64,
    /// `ip:port` of the resolver to ask; the system's (resolv.conf) when absent.
    #[serde(default)]
    pub nameserver: Option<SocketAddr>,
    /// Weight and ceiling of every discovered peer (SRV weights override the weight).
    #[serde(default = "one")]
    pub weight: u32,
    #[serde(default)]
    pub max_in_flight: Option<u32>,
}

/// Active checks: an HTTP GET per peer per interval; a peer flips after so many results in a
/// row.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthCheckConfig {
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default = "default_health_path")]
    pub path: String,
    #[serde(default = "default_health_interval")]
    pub interval_ms: u64,
    #[serde(default = "default_health_timeout")]
    pub timeout_ms: u64,
    #[serde(default = "default_flip")]
    pub healthy_after: usize,
    #[serde(default = "default_flip")]
    pub unhealthy_after: usize,
}

/// Passive ejection: a peer whose requests keep failing (connect errors, 5xx; not 4xx) is left
/// out for a while, longer each time it fails again right after.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierConfig {
    /// 0 turns ejection off.
    #[serde(default = "default_outlier_failures")]
    pub consecutive_failures: u32,
    #[serde(default = "default_base_ejection")]
    pub base_ejection_ms: u64,
    #[serde(default = "default_max_ejection")]
    pub max_ejection_ms: u64,
}

/// A peers file: just the peers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersFile {
    #[serde(default)]
    pub peers: Vec<PeerConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// Where the admin API listens; `null` turns it off. Loopback by default: it can drain peers.
    #[serde(default = "default_admin_listen")]
    pub listen: Option<String>,
    /// When set, every admin request must carry `Authorization: Bearer <token>`.
    #[serde(default)]
    pub token: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// `ip:port`, or `host:port` resolved once at load.
    pub addr: String,
    #[serde(default = "one")]
    pub weight: u32,
    /// Fixed in-flight ceiling; absent for none.
    #[serde(default)]
    pub max_in_flight: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    #[serde(default = "default_policy")]
    pub policy: Policy,
    /// `c` of the balance bound; `null` for none (only `max_in_flight` then).
    #[serde(default = "default_balance_factor")]
    pub balance_factor: Option<f64>,
    #[serde(default = "default_vnodes")]
    pub vnodes_per_weight: u32,
    /// How much of a prompt-carrying body is read, at most, to find its key.
    #[serde(default = "default_peek_limit")]
    pub peek_limit_bytes: usize,
    #[serde(default)]
    pub key: KeySourcesConfig,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceName {
    SessionHeader,
    Chat,
    Completions,
    Generate,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySourcesConfig {
    #[serde(default = "all_sources")]
    pub sources: Vec<SourceName>,
    #[serde(default = "default_session_header")]
    pub session_header: String,
    #[serde(default = "default_prefix_chars")]
    pub prefix_chars: usize,
    #[serde(default = "default_fallback")]
    pub fallback: Fallback,
    #[serde(default = "default_chat_path")]
    pub chat_path: String,
    #[serde(default = "default_completions_path")]
    pub completions_path: String,
    #[serde(default = "default_generate_path")]
    pub generate_path: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueConfig {
    /// Requests that may wait for a slot when every peer is at its bound; 0 rejects at once.
    #[serde(default = "default_max_waiting")]
    pub max_waiting: usize,
    #[serde(default = "default_queue_timeout")]
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// Longest silence while reading a response: covers the time to the first token.
    #[serde(default = "default_read_timeout")]
    pub read_timeout_ms: u64,
    #[serde(default = "default_write_timeout")]
    pub write_timeout_ms: u64,
    /// How long an idle pooled connection is kept: below the servers' keep-alive (uvicorn,
    /// under vLLM and SGLang, closes idle connections after 5 s).
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout_ms: u64,
    /// Further peers tried after a failed connect, before any byte reached the client.
    #[serde(default = "default_connect_retries")]
    pub connect_retries: usize,
}

fn default_listen() -> Vec<String> {
    vec!["127.0.0.1:8080".into()]
}
fn default_access_log() -> AccessLogFormat {
    AccessLogFormat::Plain
}
fn yes() -> bool {
    true
}
fn default_reload_interval() -> u64 {
    1_000
}
fn default_dns_record() -> DnsRecord {
    DnsRecord::A
}
fn default_dns_interval() -> u64 {
    5_000
}
fn default_health_path() -> String {
    "/health".into()
}
fn default_health_interval() -> u64 {
    2_000
}
fn default_health_timeout() -> u64 {
    1_000
}
fn default_flip() -> usize {
    2
}
fn default_outlier_failures() -> u32 {
    5
}
fn default_base_ejection() -> u64 {
    5_000
}
fn default_max_ejection() -> u64 {
    300_000
}
fn default_admin_listen() -> Option<String> {
    Some("127.0.0.1:9090".into())
}
fn one() -> u32 {
    1
}
fn default_policy() -> Policy {
    Policy::BoundedConsistentHash
}
fn default_balance_factor() -> Option<f64> {
    Some(DEFAULT_BALANCE_FACTOR)
}
fn default_vnodes() -> u32 {
    DEFAULT_VNODES_PER_WEIGHT
}
fn default_peek_limit() -> usize {
    64 * 1024
}
fn all_sources() -> Vec<SourceName> {
    vec![
        SourceName::SessionHeader,
        SourceName::Chat,
        SourceName::Completions,
        SourceName::Generate,
    ]
}
fn default_session_header() -> String {
    crate::routing::key::DEFAULT_SESSION_HEADER.into()
}
fn default_prefix_chars() -> usize {
    crate::routing::key::DEFAULT_PREFIX_CHARS
}
fn default_fallback() -> Fallback {
    Fallback::ClientAddr
}
fn default_chat_path() -> String {
    "/v1/chat/completions".into()
}
fn default_completions_path() -> String {
    "/v1/completions".into()
}
fn default_generate_path() -> String {
    "/generate".into()
}
fn default_max_waiting() -> usize {
    1024
}
fn default_queue_timeout() -> u64 {
    30_000
}
fn default_max_body() -> usize {
    32 * 1024 * 1024
}
fn default_connect_timeout() -> u64 {
    3_000
}
fn default_read_timeout() -> u64 {
    600_000
}
fn default_write_timeout() -> u64 {
    60_000
}
fn default_idle_timeout() -> u64 {
    4_000
}
fn default_connect_retries() -> usize {
    2
}

macro_rules! defaults_from_serde {
    ($($ty:ty),*) => {$(
        impl Default for $ty {
            fn default() -> Self {
                serde_yaml::from_str("{}").expect("every field has a default")
            }
        }
    )*};
}
defaults_from_serde!(
    RoutingConfig,
    KeySourcesConfig,
    QueueConfig,
    LimitsConfig,
    UpstreamConfig,
    AdminConfig,
    DiscoveryConfig,
    HealthCheckConfig,
    OutlierConfig
);

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path)
        .map_err(|e| ConfigError::new("", format!("cannot read {}: {e}", path.display())))
}

/// Parses YAML into `T`, naming the field of any error.
pub fn from_yaml<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, ConfigError> {
    let de = serde_yaml::Deserializer::from_str(text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = match e.path().to_string() {
            root if root == "." => String::new(),
            path => path,
        };
        // serde_yaml starts its message with the path of the enclosing value; the field
        // already says it.
        let message = e.into_inner().to_string();
        let reason = match message.split_once(": ") {
            Some((prefix, rest)) if !field.is_empty() && field.starts_with(prefix) => {
                rest.to_owned()
            }
            _ => message,
        };
        ConfigError::new(field, reason)
    })
}

impl PeersFile {
    pub fn parse(text: &str) -> Result<Vec<PeerSpec>, ConfigError> {
        let file: PeersFile = from_yaml(text)?;
        resolve_peers(&file.peers)
    }
}

/// The peers as the routing core takes them; hostnames are resolved here, once.
pub fn resolve_peers(peers: &[PeerConfig]) -> Result<Vec<PeerSpec>, ConfigError> {
    let mut specs = Vec::with_capacity(peers.len());
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
        if !(1..=MAX_WEIGHT).contains(&p.weight) {
            return Err(ConfigError::new(
                field("weight"),
                format!("must be from 1 to {MAX_WEIGHT}"),
            ));
        }
        if p.max_in_flight == Some(0) {
            return Err(ConfigError::new(
                field("max_in_flight"),
                "must be at least 1 (omit it for no ceiling)",
            ));
        }
        if specs.iter().any(|s: &PeerSpec| s.addr == addr) {
            return Err(ConfigError::new(
                field("addr"),
                format!("{addr} is listed twice"),
            ));
        }
        specs.push(PeerSpec {
            addr,
            weight: p.weight,
            max_in_flight: p.max_in_flight.unwrap_or(UNLIMITED),
        });
    }
    Ok(specs)
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::parse(&read(path)?)
    }

    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Config = from_yaml(text)?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.listen.is_empty() {
            return Err(ConfigError::new("listen", "at least one address is needed"));
        }
        for (i, l) in self.listen.iter().enumerate() {
            l.parse::<SocketAddr>().map_err(|e| {
                ConfigError::new(
                    format!("listen[{i}]"),
                    format!("`{l}` is not ip:port ({e})"),
                )
            })?;
        }
        if let Some(l) = &self.admin.listen {
            l.parse::<SocketAddr>().map_err(|e| {
                ConfigError::new("admin.listen", format!("`{l}` is not ip:port ({e})"))
            })?;
        }
        if self.admin.token.as_deref() == Some("") {
            return Err(ConfigError::new(
                "admin.token",
                "must not be empty (omit it for none)",
            ));
        }
        self.peer_specs()?;
        let r = &self.routing;
        if let Some(c) = r.balance_factor {
            if !(c.is_finite() && c >= 1.0) {
                return Err(ConfigError::new(
                    "routing.balance_factor",
                    format!("must be a number ≥ 1 (or null for none), not {c}"),
                ));
            }
        }
        if r.vnodes_per_weight == 0 {
            return Err(ConfigError::new(
                "routing.vnodes_per_weight",
                "must be at least 1",
            ));
        }
        if r.peek_limit_bytes == 0 {
            return Err(ConfigError::new(
                "routing.peek_limit_bytes",
                "must be at least 1",
            ));
        }
        if r.key.prefix_chars == 0 {
            return Err(ConfigError::new(
                "routing.key.prefix_chars",
                "must be at least 1",
            ));
        }
        HeaderName::from_bytes(r.key.session_header.as_bytes()).map_err(|_| {
            ConfigError::new(
                "routing.key.session_header",
                format!("`{}` is not a valid header name", r.key.session_header),
            )
        })?;
        for (field, path) in [
            ("chat_path", &r.key.chat_path),
            ("completions_path", &r.key.completions_path),
            ("generate_path", &r.key.generate_path),
        ] {
            if !path.starts_with('/') {
                return Err(ConfigError::new(
                    format!("routing.key.{field}"),
                    format!("`{path}` must start with /"),
                ));
            }
        }
        if self.limits.max_body_bytes == 0 {
            return Err(ConfigError::new(
                "limits.max_body_bytes",
                "must be at least 1",
            ));
        }
        let u = &self.upstream;
        for (field, ms) in [
            ("connect_timeout_ms", u.connect_timeout_ms),
            ("read_timeout_ms", u.read_timeout_ms),
            ("write_timeout_ms", u.write_timeout_ms),
            ("idle_timeout_ms", u.idle_timeout_ms),
        ] {
            if ms == 0 {
                return Err(ConfigError::new(
                    format!("upstream.{field}"),
                    "must be at least 1",
                ));
            }
        }
        let d = &self.discovery;
        if (d.peers_file.is_some() || d.dns.is_some()) && !self.peers.is_empty() {
            return Err(ConfigError::new(
                "peers",
                "must be empty when discovery.peers_file or discovery.dns gives the peers",
            ));
        }
        if d.peers_file.is_some() && d.dns.is_some() {
            return Err(ConfigError::new(
                "discovery",
                "peers_file and dns are two sources: choose one",
            ));
        }
        if d.reload_interval_ms == 0 {
            return Err(ConfigError::new(
                "discovery.reload_interval_ms",
                "must be at least 1",
            ));
        }
        if let Some(dns) = &d.dns {
            if dns.record == DnsRecord::A && dns.port.is_none() {
                return Err(ConfigError::new(
                    "discovery.dns.port",
                    "is needed with A/AAAA records (SRV records carry their own)",
                ));
            }
            if dns.interval_ms == 0
                || dns.weight == 0
                || dns.weight > MAX_WEIGHT
                || dns.max_in_flight == Some(0)
            {
                return Err(ConfigError::new(
                    "discovery.dns",
                    format!("interval_ms and max_in_flight must be at least 1, weight from 1 to {MAX_WEIGHT}"),
                ));
            }
        }
        let h = &self.health_check;
        if !h.path.starts_with('/') {
            return Err(ConfigError::new("health_check.path", "must start with /"));
        }
        if h.interval_ms == 0 || h.timeout_ms == 0 || h.healthy_after == 0 || h.unhealthy_after == 0
        {
            return Err(ConfigError::new(
                "health_check",
                "interval_ms, timeout_ms, healthy_after and unhealthy_after must be at least 1",
            ));
        }
        if self.outlier.base_ejection_ms == 0
            || self.outlier.max_ejection_ms < self.outlier.base_ejection_ms
        {
            return Err(ConfigError::new(
                "outlier",
                "base_ejection_ms must be at least 1 and max_ejection_ms at least base_ejection_ms",
            ));
        }
        if self.queue.max_waiting > 0 && self.queue.timeout_ms == 0 {
            return Err(ConfigError::new(
                "queue.timeout_ms",
                "must be at least 1 when max_waiting is above 0",
            ));
        }
        Ok(())
    }

    /// The peers listed in this file.
    pub fn peer_specs(&self) -> Result<Vec<PeerSpec>, ConfigError> {
        resolve_peers(&self.peers)
    }

    pub fn outlier(&self) -> OutlierPolicy {
        OutlierPolicy {
            consecutive_failures: self.outlier.consecutive_failures,
            base_ejection: Duration::from_millis(self.outlier.base_ejection_ms),
            max_ejection: Duration::from_millis(self.outlier.max_ejection_ms),
        }
    }

    pub fn key_config(&self) -> KeyConfig {
        let k = &self.routing.key;
        let on = |s: SourceName, path: &str| k.sources.contains(&s).then(|| path.to_owned());
        KeyConfig {
            session_header: k
                .sources
                .contains(&SourceName::SessionHeader)
                .then(|| HeaderName::from_bytes(k.session_header.as_bytes()).ok())
                .flatten(),
            chat_path: on(SourceName::Chat, &k.chat_path),
            completions_path: on(SourceName::Completions, &k.completions_path),
            generate_path: on(SourceName::Generate, &k.generate_path),
            prefix_chars: k.prefix_chars,
            fallback: k.fallback,
        }
    }

    pub fn balance(&self) -> Balance {
        Balance {
            policy: self.routing.policy,
            balance_factor: self.routing.balance_factor,
        }
    }

    pub fn ring(&self) -> RingConfig {
        RingConfig {
            vnodes_per_weight: self.routing.vnodes_per_weight,
        }
    }
}

impl UpstreamConfig {
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    pub fn read_timeout(&self) -> Duration {
        Duration::from_millis(self.read_timeout_ms)
    }
    pub fn write_timeout(&self) -> Duration {
        Duration::from_millis(self.write_timeout_ms)
    }
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
}

impl QueueConfig {
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}
