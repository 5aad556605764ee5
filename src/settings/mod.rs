//! What the program runs on: the configuration after it was read and checked, in the types the
//! modules use. [`crate::config`] is the only producer; every default is defined here or on the
//! routing type it belongs to, and the file's own defaults are read from these.
//!
//! One file per part they configure: `listen` (listeners, TLS files, API keys), `router`,
//! `proxy` (body limits, upstream, forwarding, access log), `admin`, `discovery` (where peers come
//! from), `control` (health checks, engine metrics, model lists, replicas) and `traces` (spans
//! sent to a collector).

mod admin;
mod control;
mod discovery;
mod listen;
mod proxy;
mod router;
mod traces;

pub use admin::AdminSettings;
pub use control::{EngineMetrics, HealthCheck, ModelDiscovery, Replicas};
pub use discovery::{
    Discovery, Dns, DnsQuery, KubeApi, KubePort, KubeSelect, Kubernetes, Registry,
};
pub use listen::{Auth, Listener, TlsFiles};
pub use proxy::{
    AccessLogFormat, ForwardingSettings, PeekLimits, ProxySettings, Upstream, UpstreamTls,
};
pub use router::RouterSettings;
pub use traces::TraceSettings;

use crate::routing::PeerSpec;

/// Everything prefixlb's file configures.
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
    /// `None`: no spans are made, and `traceparent` passes to the engines as the client sent it.
    pub tracing: Option<TraceSettings>,
}

impl Settings {
    pub const DEFAULT_LISTEN: &'static str = "127.0.0.1:8080";
}
