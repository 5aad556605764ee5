//! The proxy's settings: body limits, the upstream connections, forwarding and the access log.

use std::sync::Arc;
use std::time::Duration;

use pingora::upstreams::peer::PeerOptions;
use pingora::utils::tls::WrappedX509;
use serde::Deserialize;

use crate::routing::QueueLimit;

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
    /// Longest a request's head may take to arrive once its first byte has (HTTP/1): a client
    /// that sends it a byte at a time would otherwise hold its connection for as long as each
    /// read comes within Pingora's 60 s.
    pub client_header_timeout: Duration,
    pub forwarding: ForwardingSettings,
    /// The model a request that names none is served as, when peers are pooled by model.
    pub default_model: Option<String>,
}

impl ProxySettings {
    pub const DEFAULT_CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
    pub const DEFAULT_CLIENT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
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
            client_header_timeout: Self::DEFAULT_CLIENT_HEADER_TIMEOUT,
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
    /// The inference endpoints of the OpenAI API, the Anthropic Messages API as vLLM and SGLang
    /// serve it, vLLM and SGLang, their model lists and
    /// health. Left out on purpose: the engines' own controls (profiling, cache flushing,
    /// sleeping, weight and adapter loading), which a client must not reach through the
    /// balancer, and their metrics.
    pub const DEFAULT_PATHS: &[&str] = &[
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/responses/*",
        "/v1/messages",
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
    /// How long a peer may carry requests and send nothing on any of them before it takes no
    /// new one (zero: never). Its requests go on; only new work goes elsewhere.
    pub wedge_after: Duration,
    /// Longest silence within a streamed answer once its first byte came (zero: only
    /// `read_timeout`); the stream then ends with an error event and its slot is freed.
    pub stream_idle_timeout: Duration,
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

impl Upstream {
    /// These timeouts on a connection to an engine.
    pub fn apply_to(&self, options: &mut PeerOptions) {
        options.connection_timeout = Some(self.connect_timeout);
        options.total_connection_timeout = Some(self.connect_timeout);
        options.read_timeout = Some(self.read_timeout);
        options.write_timeout = Some(self.write_timeout);
        options.idle_timeout = Some(self.idle_timeout);
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
            wedge_after: Duration::from_secs(30),
            stream_idle_timeout: Duration::from_secs(120),
            tls: UpstreamTls::default(),
        }
    }
}

/// How the access log writes its lines (see [`crate::access_log`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessLogFormat {
    #[default]
    Plain,
    Json,
    Off,
}
