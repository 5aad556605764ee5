//! The peers, listed here or discovered: `peers` and `discovery`.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::defaults::{ms, weight_one};
use crate::settings::{self, Discovery, Dns};

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
pub struct DiscoveryFile {
    pub peers_file: Option<PathBuf>,
    /// How often a peers file (or this file) is checked for changes.
    pub reload_interval_ms: u64,
    pub dns: Option<DnsFile>,
    pub redis: Option<RedisFile>,
    pub kubernetes: Option<KubernetesFile>,
    /// Whether a reload may leave no peer at all.
    pub allow_empty: bool,
}

impl Default for DiscoveryFile {
    fn default() -> Self {
        Self {
            peers_file: None,
            reload_interval_ms: ms(Discovery::DEFAULT_INTERVAL),
            dns: None,
            redis: None,
            kubernetes: None,
            allow_empty: false,
        }
    }
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

fn kubernetes_interval_ms() -> u64 {
    ms(settings::Kubernetes::DEFAULT_INTERVAL)
}

/// A port by name or by number.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum PortFile {
    Number(u16),
    Name(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesFile {
    #[serde(default)]
    pub namespace: Option<String>,
    /// One Service by name, or the Services of a label selector.
    #[serde(default)]
    pub service: Option<String>,
    #[serde(default)]
    pub selector: Option<String>,
    #[serde(default)]
    pub port: Option<PortFile>,
    #[serde(default = "kubernetes_interval_ms")]
    pub interval_ms: u64,
    #[serde(default = "weight_one")]
    pub weight: u32,
    #[serde(default)]
    pub max_in_flight: Option<u32>,
    /// Neither this nor `api_server`: the pod's service account.
    #[serde(default)]
    pub kubeconfig: Option<PathBuf>,
    #[serde(default)]
    pub context: Option<String>,
    #[serde(default)]
    pub api_server: Option<String>,
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
}
