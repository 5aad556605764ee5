//! The file as users write it, one submodule per part it configures. Each section's defaults
//! are read from the settings type it becomes, so a default is defined once; `convert` checks
//! the values and turns them into [`crate::settings::Settings`]. Nothing here outlives start-up
//! or a reload. `docs/configuration.md` describes every key; a test keeps the two in step.

mod defaults;
pub mod engines;
pub mod peers;
pub mod proxy;
pub mod routing;
mod switch;
pub mod traces;
pub mod tuning;

use std::path::PathBuf;

use serde::Deserialize;

use self::engines::{EngineMetricsFile, HealthCheck, ModelsFile};
use self::peers::{DiscoveryFile, Peer};
use self::proxy::{AccessLog, Forwarding, Proxy, Queue, Upstream};
use self::routing::{Endpoints, Outlier, Routing};
use self::traces::TracingFile;
use self::tuning::Advanced;
use crate::settings::{AdminSettings, Settings};

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct File {
    pub listen: Vec<Listen>,
    /// Whether plain listeners take HTTP/2 without TLS too.
    pub h2c: bool,
    pub auth: Option<AuthFile>,
    pub peers: Vec<Peer>,
    pub routing: Routing,
    pub endpoints: Endpoints,
    pub proxy: Proxy,
    pub queue: Queue,
    pub upstream: Upstream,
    pub forwarding: Forwarding,
    pub access_log: AccessLog,
    pub admin: Admin,
    pub discovery: DiscoveryFile,
    pub health_check: HealthCheck,
    pub outlier: Outlier,
    pub engine_metrics: EngineMetricsFile,
    pub models: ModelsFile,
    pub replicas: Option<ReplicasFile>,
    pub tracing: Option<TracingFile>,
    pub advanced: Advanced,
}

impl Default for File {
    fn default() -> Self {
        Self {
            listen: vec![Listen::Addr(Settings::DEFAULT_LISTEN.into())],
            h2c: false,
            auth: None,
            peers: Vec::new(),
            routing: Routing::default(),
            endpoints: Endpoints::default(),
            proxy: Proxy::default(),
            queue: Queue::default(),
            upstream: Upstream::default(),
            forwarding: Forwarding::default(),
            access_log: AccessLog::default(),
            admin: Admin::default(),
            discovery: DiscoveryFile::default(),
            health_check: HealthCheck::default(),
            outlier: Outlier::default(),
            engine_metrics: EngineMetricsFile::default(),
            models: ModelsFile::default(),
            replicas: None,
            tracing: None,
            advanced: Advanced::default(),
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
    /// The keys the datagrams are signed with: one or two lines of hex.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}
