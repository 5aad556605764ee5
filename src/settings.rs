//! What the program runs on: the configuration after it was read and checked, in the types the
//! modules use. [`crate::config`] is the only producer; every default is defined here or on the
//! routing type it belongs to, and the file's own defaults are read from these.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pingora::utils::tls::WrappedX509;

use crate::access_log::AccessLogFormat;
use crate::routing::{Balance, KeyConfig, OutlierPolicy, PeerSpec, QueueLimit, RingConfig, Weight};

#[derive(Debug, Clone)]
pub struct Settings {
    /// Where the proxy listens.
    pub listen: Vec<Listener>,
    /// Whether the plain listeners also take HTTP/2 without TLS (prior knowledge); the TLS
    /// ones offer it by ALPN either way.
    pub h2c: bool,
    /// `None`: no API keys; anyone who reaches a listener is served.
    pub auth: Option<Auth>,
    /// The peers listed in the file itself; a peers file or DNS gives them otherwise.
    pub peers: Vec<PeerSpec>,
    pub router: RouterSettings,
    pub proxy: ProxySettings,
    pub admin: Option<AdminSettings>,
    pub discovery: Discovery,
    /// Whether a reload may leave no peer at all. Off, an empty list (a file caught mid-write or
    /// emptied by mistake, a DNS name gone) is refused and the current peers stay.
    pub allow_empty_peers: bool,
    /// `None`: no active checks; every peer counts as healthy.
    pub health_check: Option<HealthCheck>,
    /// `None`: the engines' own metrics are not read.
    pub engine_metrics: Option<EngineMetrics>,
    /// `None`: peers serve the models they are listed with, or any.
    pub model_discovery: Option<ModelDiscovery>,
    /// `None`: this process tells no other prefixlb where prompts went.
    pub replicas: Option<Replicas>,
}

/// The other prefixlb processes in front of the same peers, told where prompts went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replicas {
    /// Where this process hears the others (UDP).
    pub listen: SocketAddr,
    /// Where the others hear (UDP).
    pub others: Vec<SocketAddr>,
}

/// Asking each peer that lists no models which it serves (`GET /v1/models`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDiscovery {
    pub interval: Duration,
    pub timeout: Duration,
}

impl ModelDiscovery {
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
}

impl Settings {
    pub const DEFAULT_LISTEN: &'static str = "127.0.0.1:8080";
}

/// One address the proxy listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    pub addr: SocketAddr,
    pub tls: Option<TlsFiles>,
}

/// A certificate chain and its private key, in PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Client authentication by API key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    /// The keys (as SHA-256 digests) and each key's limits; read again when it changes.
    pub keys_file: PathBuf,
    /// Whether the client's `Authorization` header goes on to the engine.
    pub forward_key: bool,
}

/// How the router routes.
#[derive(Debug, Clone)]
pub struct RouterSettings {
    pub keys: KeyConfig,
    pub balance: Balance,
    pub ring: RingConfig,
    pub outlier: OutlierPolicy,
    /// Memory of the record of where prompt blocks went.
    pub record_bytes: usize,
}

impl Default for RouterSettings {
    fn default() -> Self {
        Self {
            keys: KeyConfig::default(),
            balance: Balance::default(),
            ring: RingConfig::default(),
            outlier: OutlierPolicy::default(),
            record_bytes: crate::routing::record::DEFAULT_BYTES,
        }
    }
}

/// What the proxy needs of its own: how much body it reads, how it talks to peers, how long a
/// request may wait for a slot, and its access log.
#[derive(Debug, Clone)]
pub struct ProxySettings {
    pub peek: PeekLimits,
    pub upstream: Upstream,
    pub queue: QueueLimit,
    pub access_log: AccessLogFormat,
    /// The secret the access log's key hashes are keyed with; a random one per process when
    /// `None`.
    pub access_log_key: Option<String>,
    /// Longest a write to the client may block: a client that stops reading loses its response,
    /// and its slot goes back, after this. Without it, a stream nobody reads holds a slot for
    /// ever (the proxy stops reading the engine, so no upstream timeout fires either).
    pub client_write_timeout: Duration,
    pub forwarding: ForwardingSettings,
    /// The model a request that names none is served as, when peers are pooled by model.
    pub default_model: Option<String>,
}

impl ProxySettings {
    pub const DEFAULT_CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
}

impl Default for ProxySettings {
    fn default() -> Self {
        Self {
            peek: PeekLimits::default(),
            upstream: Upstream::default(),
            queue: QueueLimit::default(),
            access_log: AccessLogFormat::default(),
            access_log_key: None,
            client_write_timeout: Self::DEFAULT_CLIENT_WRITE_TIMEOUT,
            forwarding: ForwardingSettings::default(),
            default_model: None,
        }
    }
}

/// What is forwarded, and what the engines are told of the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardingSettings {
    /// Proxies in front of this one: their `X-Forwarded-For` is appended to, anyone else's
    /// replaced.
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// The header a request id is read from and passed on in; `None`: no request ids.
    pub request_id_header: Option<http::HeaderName>,
    /// Paths forwarded (exactly, or below an entry ending in `/*`); `None`: every path.
    pub allowed_paths: Option<Vec<String>>,
}

impl ForwardingSettings {
    /// The inference endpoints of the OpenAI API, vLLM and SGLang, their model lists and
    /// health. Left out on purpose: the engines' own controls (profiling, cache flushing,
    /// sleeping, weight and adapter loading), which a client must not reach through the
    /// balancer, and their metrics.
    pub const DEFAULT_PATHS: &[&str] = &[
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/responses/*",
        "/v1/models",
        "/v1/models/*",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/rerank",
        "/v2/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/classify",
        "/pooling",
        "/tokenize",
        "/detokenize",
        "/generate",
        "/encode",
        "/get_model_info",
        "/health",
        "/health_generate",
        "/ping",
        "/version",
    ];
}

impl Default for ForwardingSettings {
    fn default() -> Self {
        Self {
            trusted_proxies: Vec::new(),
            request_id_header: Some(http::HeaderName::from_static("x-request-id")),
            allowed_paths: Some(Self::DEFAULT_PATHS.iter().map(|p| p.to_string()).collect()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeekLimits {
    /// How much of a prompt-carrying body is read, at most, to find its key.
    pub peek_limit: usize,
    pub max_body: usize,
    /// How long reading that much may take in all; 408 after it.
    pub deadline: Duration,
    /// Body bytes all peeks together may hold; 503 beyond it.
    pub memory: usize,
}

impl Default for PeekLimits {
    fn default() -> Self {
        Self {
            peek_limit: 64 * 1024,
            max_body: 32 * 1024 * 1024,
            deadline: Duration::from_secs(30),
            memory: 256 * 1024 * 1024,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Upstream {
    pub connect_timeout: Duration,
    /// Longest silence while reading a response: covers the time to the first token.
    pub read_timeout: Duration,
    pub write_timeout: Duration,
    /// How long an idle pooled connection is kept: below the servers' keep-alive (uvicorn,
    /// under vLLM and SGLang, closes idle connections after 5 s).
    pub idle_timeout: Duration,
    /// Further peers tried after a failed connect, before any byte reached the client.
    pub connect_retries: usize,
    /// How the peers reached over TLS are checked.
    pub tls: UpstreamTls,
}

/// How an engine's certificate is checked.
#[derive(Clone)]
pub struct UpstreamTls {
    /// The CA certificates to trust; the system's when `None`.
    pub ca: Option<Arc<[WrappedX509]>>,
    /// Off only for test set-ups: a certificate is then taken unchecked.
    pub verify: bool,
}

impl Default for UpstreamTls {
    fn default() -> Self {
        Self {
            ca: None,
            verify: true,
        }
    }
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("ca_certificates", &self.ca.as_ref().map(|ca| ca.len()))
            .field("verify", &self.verify)
            .finish()
    }
}

impl Default for Upstream {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(3),
            read_timeout: Duration::from_secs(600),
            write_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(4),
            connect_retries: 2,
            tls: UpstreamTls::default(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminSettings {
    /// Loopback by default: the admin API can drain peers.
    pub listen: SocketAddr,
    /// When set, every admin request but `/metrics` must carry `Authorization: Bearer <token>`.
    pub token: Option<String>,
}

impl Default for AdminSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            token: None,
        }
    }
}

/// Where the peers come from after start; files are re-read when they change and on SIGHUP.
#[derive(Debug, Clone, PartialEq)]
pub enum Discovery {
    /// The `peers` section of prefixlb's own file.
    ConfigFile {
        interval: Duration,
    },
    /// A YAML file holding `peers: [...]`.
    PeersFile {
        path: PathBuf,
        interval: Duration,
    },
    Dns(Dns),
    /// A registry of engine nodes kept alive by heartbeats (see `prefixlb-agent`).
    Redis(Registry),
}

/// Peers as the keys `prefix<addr>` of a Redis database, each holding
/// `{"weight": …, "max_in_flight": …}` and expiring unless its engine's agent refreshes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registry {
    /// `redis://[user:password@]host:port[/db]`, or `rediss://` for TLS.
    pub url: String,
    pub prefix: String,
    pub interval: Duration,
}

impl Registry {
    /// The URL as logs may show it: without its password.
    pub fn url_without_secret(&self) -> String {
        match (self.url.find("://"), self.url.rfind('@')) {
            (Some(scheme), Some(at)) if at > scheme => {
                format!("{}***{}", &self.url[..scheme + 3], &self.url[at..])
            }
            _ => self.url.clone(),
        }
    }

    pub const DEFAULT_PREFIX: &'static str = "prefixlb:peers:";
    pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(500);
}

impl Discovery {
    /// How often a file is checked for changes.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
}

#[derive(Debug, Clone, PartialEq)]
pub struct Dns {
    /// e.g. `vllm.inference.svc.cluster.local` (a Kubernetes headless service).
    pub name: String,
    pub query: DnsQuery,
    pub interval: Duration,
    /// The resolver to ask; the system's (resolv.conf) when absent.
    pub nameserver: Option<SocketAddr>,
    /// Weight of every discovered peer, unless its SRV record gives one.
    pub weight: Weight,
    /// [`crate::routing::UNLIMITED`] for no ceiling.
    pub max_in_flight: u32,
    /// The name every discovered peer's certificate is checked for, when they are reached
    /// over TLS.
    pub tls: Option<String>,
    /// Rounds in a row an SRV target may fail to resolve before its last good addresses are
    /// dropped: one failed lookup must not move keys.
    pub failures_before_removal: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DnsQuery {
    /// A and AAAA records, each address with this port.
    A { port: u16 },
    /// SRV records: target, port and weight from the record.
    Srv,
}

impl Dns {
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);
    pub const DEFAULT_FAILURES_BEFORE_REMOVAL: u32 = 3;
}

/// Active checks: an HTTP GET per peer per interval; a peer flips after so many results in a
/// row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub healthy_after: usize,
    pub unhealthy_after: usize,
}

/// Reading each engine's Prometheus endpoint for its running and waiting requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineMetrics {
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self {
            path: "/metrics".into(),
            interval: Duration::from_millis(200),
            timeout: Duration::from_millis(150),
        }
    }
}

impl Default for HealthCheck {
    fn default() -> Self {
        Self {
            path: "/health".into(),
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            healthy_after: 2,
            unhealthy_after: 2,
        }
    }
}
