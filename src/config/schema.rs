//! The file as users write it. Each section's defaults are read from the settings type it
//! becomes, so a default is defined once; `convert` checks the values and turns them into
//! [`crate::settings::Settings`]. Nothing here outlives start-up or a reload.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::routing::{
    Balance, Fallback, KeyConfig, KeySource, OutlierPolicy, Policy, QueueLimit, RingConfig, Weight,
};
use crate::settings::AccessLogFormat;
use crate::settings::{
    self, AdminSettings, Discovery, Dns, ForwardingSettings, PeekLimits, ProxySettings, Settings,
};

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

fn weight_one() -> u32 {
    Weight::ONE.get()
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct File {
    pub listen: Vec<Listen>,
    /// Whether plain listeners take HTTP/2 without TLS too.
    pub h2c: bool,
    pub auth: Option<AuthFile>,
    pub peers: Vec<Peer>,
    pub routing: Routing,
    pub queue: Queue,
    pub limits: Limits,
    pub upstream: Upstream,
    pub admin: Admin,
    pub discovery: DiscoveryFile,
    pub health_check: HealthCheck,
    pub outlier: Outlier,
    pub forwarding: Forwarding,
    pub engine_metrics: EngineMetricsFile,
    pub models: ModelsFile,
    pub replicas: Option<ReplicasFile>,
    /// One line per request on standard output: plain, json or off.
    pub access_log: AccessLogFormat,
    /// The secret the log's key hashes are keyed with (the same on every replica, for logs
    /// that group across them); a random one per process when absent.
    pub access_log_key: Option<String>,
}

impl Default for File {
    fn default() -> Self {
        Self {
            listen: vec![Listen::Addr(Settings::DEFAULT_LISTEN.into())],
            h2c: false,
            auth: None,
            peers: Vec::new(),
            routing: Routing::default(),
            queue: Queue::default(),
            limits: Limits::default(),
            upstream: Upstream::default(),
            admin: Admin::default(),
            discovery: DiscoveryFile::default(),
            health_check: HealthCheck::default(),
            outlier: Outlier::default(),
            forwarding: Forwarding::default(),
            engine_metrics: EngineMetricsFile::default(),
            models: ModelsFile::default(),
            replicas: None,
            access_log: AccessLogFormat::default(),
            access_log_key: None,
        }
    }
}

/// A listener: `ip:port`, or `{addr, tls: {cert, key}}`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Listen {
    Addr(String),
    Full(ListenFull),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenFull {
    pub addr: String,
    #[serde(default)]
    pub tls: Option<ListenTls>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenTls {
    /// The certificate chain, leaf first (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthFile {
    pub keys_file: PathBuf,
    #[serde(default)]
    pub forward_key: bool,
}

/// A peers file: just the peers.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeersFile {
    #[serde(default)]
    pub peers: Vec<Peer>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peer {
    /// `ip:port`, or `host:port` resolved once at load.
    pub addr: String,
    #[serde(default = "weight_one")]
    pub weight: u32,
    /// Fixed in-flight ceiling; absent for none.
    #[serde(default)]
    pub max_in_flight: Option<u32>,
    /// Whether the peer is reached over TLS.
    #[serde(default)]
    pub tls: bool,
    /// The name its certificate is checked for; the host of `addr` when absent.
    #[serde(default)]
    pub sni: Option<String>,
    /// The models (and LoRA adapters) it serves; absent: learned from its `/v1/models`, or any.
    #[serde(default)]
    pub models: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Routing {
    pub policy: Policy,
    /// `c` of the balance bound; `null` for none (only `max_in_flight` then).
    pub balance_factor: Option<f64>,
    /// What `least_cost` prices a prompt at: the tokens a GPU prefills per second.
    pub prefill_tokens_per_second: f64,
    /// How many peers of a key's walk `least_cost` prices, its own first.
    pub candidates: u32,
    /// Whether a conversation new to this process goes where its system prompt went.
    pub shared_prefix_placement: bool,
    /// Memory of the record of where prompt blocks went, in MiB.
    pub prefix_record_mib: usize,
    pub vnodes_per_weight: u32,
    /// How much of a prompt-carrying body is read, at most, to find its key.
    pub peek_limit_bytes: usize,
    /// How long reading it may take in all.
    pub peek_timeout_ms: u64,
    pub key: Key,
}

impl Default for Routing {
    fn default() -> Self {
        let balance = Balance::default();
        Self {
            policy: balance.policy,
            balance_factor: balance.balance_factor,
            prefill_tokens_per_second: balance.cost.prefill_tokens_per_sec,
            candidates: balance.cost.candidates,
            shared_prefix_placement: balance.cost.shared_prefix_placement,
            prefix_record_mib: crate::routing::record::DEFAULT_BYTES >> 20,
            vnodes_per_weight: RingConfig::default().vnodes_per_weight,
            peek_limit_bytes: PeekLimits::default().peek_limit,
            peek_timeout_ms: ms(PeekLimits::default().deadline),
            key: Key::default(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Key {
    /// Which of session_header, chat, completions and generate may give a key.
    pub sources: Vec<KeySource>,
    pub session_header: String,
    pub prefix_chars: usize,
    pub fallback: Fallback,
    pub chat_path: String,
    pub completions_path: String,
    pub generate_path: String,
}

impl Default for Key {
    fn default() -> Self {
        let k = KeyConfig::default();
        let path = |p: Option<String>| p.unwrap_or_default();
        Self {
            sources: vec![
                KeySource::SessionHeader,
                KeySource::Chat,
                KeySource::Completions,
                KeySource::Generate,
            ],
            session_header: k
                .session_header
                .map(|h| h.as_str().to_owned())
                .unwrap_or_default(),
            prefix_chars: k.prefix_chars,
            fallback: k.fallback,
            chat_path: path(k.chat_path),
            completions_path: path(k.completions_path),
            generate_path: path(k.generate_path),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Queue {
    /// Requests that may wait for a slot when every peer is at its bound; 0 rejects at once.
    pub max_waiting: usize,
    pub timeout_ms: u64,
}

impl Default for Queue {
    fn default() -> Self {
        let q = QueueLimit::default();
        Self {
            max_waiting: q.max_waiting,
            timeout_ms: ms(q.timeout),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    pub max_body_bytes: usize,
    /// Body bytes that all requests together may hold while their keys are read.
    pub peek_memory_bytes: usize,
    /// Longest a write to the client may block before its stream is ended.
    pub client_write_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: PeekLimits::default().max_body,
            peek_memory_bytes: PeekLimits::default().memory,
            client_write_timeout_ms: ms(ProxySettings::DEFAULT_CLIENT_WRITE_TIMEOUT),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Upstream {
    pub connect_timeout_ms: u64,
    pub read_timeout_ms: u64,
    pub write_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub connect_retries: usize,
    pub tls: UpstreamTlsFile,
}

/// How engines reached over TLS are checked.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamTlsFile {
    /// CA certificates to trust (PEM); the system's when absent.
    pub ca_file: Option<PathBuf>,
    pub verify: bool,
}

impl Default for UpstreamTlsFile {
    fn default() -> Self {
        Self {
            ca_file: None,
            verify: settings::UpstreamTls::default().verify,
        }
    }
}

impl Default for Upstream {
    fn default() -> Self {
        let u = settings::Upstream::default();
        Self {
            connect_timeout_ms: ms(u.connect_timeout),
            read_timeout_ms: ms(u.read_timeout),
            write_timeout_ms: ms(u.write_timeout),
            idle_timeout_ms: ms(u.idle_timeout),
            connect_retries: u.connect_retries,
            tls: UpstreamTlsFile::default(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Admin {
    /// `null` turns the admin listener off.
    pub listen: Option<String>,
    pub token: Option<String>,
}

impl Default for Admin {
    fn default() -> Self {
        let a = AdminSettings::default();
        Self {
            listen: Some(a.listen.to_string()),
            token: a.token,
        }
    }
}

/// The other prefixlb processes in front of the same peers.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicasFile {
    /// `ip:port` where this process hears the others (UDP).
    pub listen: String,
    /// `ip:port` of each of the others.
    pub others: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryFile {
    pub peers_file: Option<PathBuf>,
    /// How often a peers file (or this file) is checked for changes.
    pub reload_interval_ms: u64,
    pub dns: Option<DnsFile>,
    pub redis: Option<RedisFile>,
    /// Whether a reload may leave no peer at all.
    pub allow_empty: bool,
}

fn registry_prefix() -> String {
    settings::Registry::DEFAULT_PREFIX.into()
}

fn registry_interval_ms() -> u64 {
    ms(settings::Registry::DEFAULT_INTERVAL)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisFile {
    pub url: String,
    #[serde(default = "registry_prefix")]
    pub prefix: String,
    #[serde(default = "registry_interval_ms")]
    pub interval_ms: u64,
}

impl Default for DiscoveryFile {
    fn default() -> Self {
        Self {
            peers_file: None,
            reload_interval_ms: ms(Discovery::DEFAULT_INTERVAL),
            dns: None,
            redis: None,
            allow_empty: false,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DnsRecord {
    #[default]
    A,
    Srv,
}

fn dns_interval_ms() -> u64 {
    ms(Dns::DEFAULT_INTERVAL)
}

fn dns_failures_before_removal() -> u32 {
    Dns::DEFAULT_FAILURES_BEFORE_REMOVAL
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsFile {
    pub name: String,
    #[serde(default)]
    pub record: DnsRecord,
    /// The port of every address (A/AAAA records).
    #[serde(default)]
    pub port: Option<u16>,
    #[serde(default = "dns_interval_ms")]
    pub interval_ms: u64,
    #[serde(default)]
    pub nameserver: Option<SocketAddr>,
    #[serde(default = "weight_one")]
    pub weight: u32,
    #[serde(default)]
    pub max_in_flight: Option<u32>,
    /// Whether the peers are reached over TLS, their certificates checked for `name` (or
    /// `sni`).
    #[serde(default)]
    pub tls: bool,
    #[serde(default)]
    pub sni: Option<String>,
    #[serde(default = "dns_failures_before_removal")]
    pub failures_before_removal: u32,
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthCheck {
    pub enabled: bool,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub healthy_after: usize,
    pub unhealthy_after: usize,
}

impl Default for HealthCheck {
    fn default() -> Self {
        let h = settings::HealthCheck::default();
        Self {
            enabled: true,
            path: h.path,
            interval_ms: ms(h.interval),
            timeout_ms: ms(h.timeout),
            healthy_after: h.healthy_after,
            unhealthy_after: h.unhealthy_after,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Outlier {
    /// 0 turns ejection off.
    pub consecutive_failures: u32,
    pub base_ejection_ms: u64,
    pub max_ejection_ms: u64,
    /// The most peers ejected at once, in percent of the members (one always may be).
    pub max_ejected_percent: u32,
}

impl Default for Outlier {
    fn default() -> Self {
        let o = OutlierPolicy::default();
        Self {
            consecutive_failures: o.consecutive_failures,
            base_ejection_ms: ms(o.base_ejection),
            max_ejection_ms: ms(o.max_ejection),
            max_ejected_percent: o.max_ejected_percent,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Forwarding {
    /// Networks (`10.0.0.0/8`, or one address) of proxies whose `X-Forwarded-For` is kept.
    pub trusted_proxies: Vec<String>,
    /// `null` turns request ids off.
    pub request_id_header: Option<String>,
    /// `null` forwards every path.
    pub allowed_paths: Option<Vec<String>>,
}

impl Default for Forwarding {
    fn default() -> Self {
        let f = ForwardingSettings::default();
        Self {
            trusted_proxies: Vec::new(),
            request_id_header: f.request_id_header.map(|h| h.as_str().to_owned()),
            allowed_paths: f.allowed_paths,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineMetricsFile {
    pub enabled: bool,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
}

impl Default for EngineMetricsFile {
    fn default() -> Self {
        let e = settings::EngineMetrics::default();
        Self {
            enabled: true,
            path: e.path,
            interval_ms: ms(e.interval),
            timeout_ms: ms(e.timeout),
        }
    }
}

/// Pools by model.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelsFile {
    /// The model of a request that names none.
    pub default: Option<String>,
    /// Whether a peer that lists no models is asked for its `/v1/models`. Off by default: an
    /// engine's list names its model, and requests naming another (as clients written for any
    /// OpenAI endpoint do) would then find no pool.
    pub discover: bool,
    pub interval_ms: u64,
}

impl Default for ModelsFile {
    fn default() -> Self {
        Self {
            default: None,
            discover: false,
            interval_ms: ms(settings::ModelDiscovery::DEFAULT_INTERVAL),
        }
    }
}
