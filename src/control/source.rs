//! Where the peer list comes from, and reading it again.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;

use crate::config::{Config, ConfigError, DnsConfig, DnsRecord, PeersFile};
use crate::routing::{PeerSpec, MAX_WEIGHT, UNLIMITED};

pub enum PeerSource {
    /// The `peers` section of prefixlb's own file.
    ConfigFile(FileSource),
    /// A file of its own.
    PeersFile(FileSource),
    Dns(Box<DnsSource>),
}

pub struct FileSource {
    path: PathBuf,
    /// What the file held when it was last read, so that an unchanged file is not parsed.
    last: Option<String>,
    interval: Duration,
}

pub struct DnsSource {
    config: DnsConfig,
    resolver: TokioResolver,
}

impl PeerSource {
    pub fn from_config(config: &Config, config_path: &Path) -> Result<Self, ConfigError> {
        let interval = Duration::from_millis(config.discovery.reload_interval_ms);
        if let Some(dns) = &config.discovery.dns {
            return Ok(PeerSource::Dns(Box::new(DnsSource::new(dns.clone())?)));
        }
        let file = |path: &Path, last: Option<String>| FileSource {
            path: path.to_owned(),
            last,
            interval,
        };
        Ok(match &config.discovery.peers_file {
            // Relative to where prefixlb started, not to / where a daemon runs.
            Some(path) => PeerSource::PeersFile(file(
                &std::fs::canonicalize(path).unwrap_or_else(|_| path.clone()),
                None,
            )),
            // Parsed again at the first tick: an edit made since start-up is not lost.
            None => PeerSource::ConfigFile(file(config_path, None)),
        })
    }

    pub fn label(&self) -> String {
        match self {
            PeerSource::ConfigFile(f) | PeerSource::PeersFile(f) => f.path.display().to_string(),
            PeerSource::Dns(d) => format!("dns {}", d.config.name),
        }
    }

    pub fn interval(&self) -> Duration {
        match self {
            PeerSource::ConfigFile(f) | PeerSource::PeersFile(f) => f.interval,
            PeerSource::Dns(d) => Duration::from_millis(d.config.interval_ms),
        }
    }

    /// The peers the source lists now; `Ok(None)` when a file is unchanged since the last read
    /// and `force` is off.
    pub async fn load(&mut self, force: bool) -> Result<Option<Vec<PeerSpec>>, ConfigError> {
        let (text, whole_config) = match self {
            PeerSource::Dns(d) => return d.resolve().await.map(Some),
            PeerSource::ConfigFile(f) => (f.changed(force).await?, true),
            PeerSource::PeersFile(f) => (f.changed(force).await?, false),
        };
        let Some(text) = text else {
            return Ok(None);
        };
        // Peer hostnames resolve through the system's blocking resolver: off the runtime.
        let parsed = tokio::task::spawn_blocking(move || {
            if whole_config {
                Config::parse(&text)?.peer_specs()
            } else {
                PeersFile::parse(&text)
            }
        })
        .await
        .map_err(|e| ConfigError::new("", format!("reading the peers failed: {e}")))?;
        parsed.map(Some)
    }
}

impl FileSource {
    async fn changed(&mut self, force: bool) -> Result<Option<String>, ConfigError> {
        let text = tokio::fs::read_to_string(&self.path).await.map_err(|e| {
            ConfigError::new("", format!("cannot read {}: {e}", self.path.display()))
        })?;
        if !force && self.last.as_ref() == Some(&text) {
            return Ok(None);
        }
        self.last = Some(text.clone());
        Ok(Some(text))
    }
}

impl DnsSource {
    fn new(config: DnsConfig) -> Result<Self, ConfigError> {
        let provider = TokioRuntimeProvider::default();
        let mut builder = match config.nameserver {
            Some(ns) => {
                let mut udp = ConnectionConfig::udp();
                udp.port = ns.port();
                let mut tcp = ConnectionConfig::tcp();
                tcp.port = ns.port();
                let server = NameServerConfig::new(ns.ip(), true, vec![udp, tcp]);
                TokioResolver::builder_with_config(
                    ResolverConfig::from_name_servers(vec![server]),
                    provider,
                )
            }
            None => TokioResolver::builder(provider).map_err(|e| {
                ConfigError::new("discovery.dns", format!("no system resolver: {e}"))
            })?,
        };
        // prefixlb asks again every interval: that, not the record TTL, is how fresh it is.
        builder.options_mut().cache_size = 0;
        let resolver = builder.build().map_err(|e| {
            ConfigError::new("discovery.dns", format!("cannot build the resolver: {e}"))
        })?;
        Ok(Self { config, resolver })
    }

    async fn resolve(&self) -> Result<Vec<PeerSpec>, ConfigError> {
        let c = &self.config;
        let fail = |e: hickory_resolver::net::NetError| {
            ConfigError::new("discovery.dns.name", format!("resolving {}: {e}", c.name))
        };
        let max_in_flight = c.max_in_flight.unwrap_or(UNLIMITED);
        let mut specs = Vec::new();
        match c.record {
            DnsRecord::A => {
                let port = c.port.unwrap_or_default();
                for ip in self
                    .resolver
                    .lookup_ip(c.name.as_str())
                    .await
                    .map_err(fail)?
                    .iter()
                {
                    specs.push(PeerSpec {
                        addr: (ip, port).into(),
                        weight: c.weight,
                        max_in_flight,
                    });
                }
            }
            DnsRecord::Srv => {
                let lookup = self
                    .resolver
                    .srv_lookup(c.name.as_str())
                    .await
                    .map_err(fail)?;
                let mut last_error = None;
                for record in lookup.answers() {
                    let RData::SRV(srv) = &record.data else {
                        continue;
                    };
                    // A target that does not resolve (a pod going away) is skipped, not a
                    // reason to ignore the others.
                    let target = srv.target.to_string();
                    let ips = match self.resolver.lookup_ip(target.as_str()).await {
                        Ok(ips) => ips,
                        Err(e) => {
                            last_error = Some(e);
                            continue;
                        }
                    };
                    for ip in ips.iter() {
                        specs.push(PeerSpec {
                            addr: (ip, srv.port).into(),
                            weight: u32::from(srv.weight).clamp(1, MAX_WEIGHT),
                            max_in_flight,
                        });
                    }
                }
                if let (true, Some(e)) = (specs.is_empty(), last_error) {
                    return Err(fail(e));
                }
            }
        }
        specs.sort_by_key(|s| s.addr);
        specs.dedup_by_key(|s| s.addr);
        Ok(specs)
    }
}
