//! Where the peer list comes from, and reading it again.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;

use super::registry::RegistrySource;
use super::watch::SettledFile;
use crate::config;
use crate::error::Error;
use crate::routing::{PeerSpec, Weight};
use crate::settings::{Discovery, Dns, DnsQuery};

pub enum PeerSource {
    /// The `peers` section of prefixlb's own file.
    ConfigFile(FileSource),
    /// A file of its own.
    PeersFile(FileSource),
    Dns(DnsSource),
    Redis(Box<RegistrySource>),
}

pub struct FileSource {
    file: SettledFile,
    interval: Duration,
}

pub struct DnsSource {
    settings: Dns,
    /// Each SRV target's last good addresses, and how many rounds in a row it has failed since.
    targets: HashMap<String, (Vec<IpAddr>, u32)>,
}

impl PeerSource {
    pub fn new(discovery: &Discovery, config_path: &Path) -> Result<Self, Error> {
        let file = |path: &Path, interval: Duration| FileSource {
            file: SettledFile::new(path.to_owned()),
            interval,
        };
        Ok(match discovery {
            Discovery::Dns(dns) => {
                let source = DnsSource {
                    settings: dns.clone(),
                    targets: HashMap::new(),
                };
                // A resolver that cannot be built is a configuration error: say so at start.
                source.resolver()?;
                PeerSource::Dns(source)
            }
            Discovery::Redis(registry) => {
                PeerSource::Redis(Box::new(RegistrySource::new(registry)?))
            }
            // Relative to where prefixlb started, not to / where a daemon runs.
            Discovery::PeersFile { path, interval } => PeerSource::PeersFile(file(
                &std::fs::canonicalize(path).unwrap_or_else(|_| path.clone()),
                *interval,
            )),
            // Parsed again at the first tick: an edit made since start-up is not lost.
            Discovery::ConfigFile { interval } => {
                PeerSource::ConfigFile(file(config_path, *interval))
            }
        })
    }

    pub fn label(&self) -> String {
        match self {
            PeerSource::ConfigFile(f) | PeerSource::PeersFile(f) => {
                f.file.path().display().to_string()
            }
            PeerSource::Dns(d) => format!("dns {}", d.settings.name),
            PeerSource::Redis(r) => r.label(),
        }
    }

    pub fn interval(&self) -> Duration {
        match self {
            PeerSource::ConfigFile(f) | PeerSource::PeersFile(f) => f.interval,
            PeerSource::Dns(d) => d.settings.interval,
            PeerSource::Redis(r) => r.interval(),
        }
    }

    /// Drops the connections the source keeps: they belong to the runtime they were made on.
    pub fn disconnect(&mut self) {
        if let PeerSource::Redis(r) = self {
            r.disconnect();
        }
    }

    /// The peers the source lists now; `Ok(None)` when a file is unchanged since the last read
    /// and `force` is off.
    pub async fn load(&mut self, force: bool) -> Result<Option<Vec<PeerSpec>>, Error> {
        let (text, whole_config) = match self {
            PeerSource::Dns(d) => return d.resolve().await.map(Some),
            PeerSource::Redis(r) => return r.read().await.map(Some),
            PeerSource::ConfigFile(f) => (f.file.changed(force).await?, true),
            PeerSource::PeersFile(f) => (f.file.changed(force).await?, false),
        };
        let Some(text) = text else {
            return Ok(None);
        };
        // Peer hostnames resolve through the system's blocking resolver: off the runtime.
        let parsed = tokio::task::spawn_blocking(move || {
            if whole_config {
                config::parse(&text).map(|s| s.peers)
            } else {
                config::parse_peers_file(&text)
            }
        })
        .await
        .map_err(|e| Error::new("", format!("reading the peers failed: {e}")))?;
        Ok(Some(parsed?))
    }
}

impl DnsSource {
    /// A resolver for one round of lookups. Its sockets belong to the runtime it is built on,
    /// and the first load runs on another runtime than the control plane: a resolver per round
    /// keeps each on its own.
    fn resolver(&self) -> Result<TokioResolver, Error> {
        let provider = TokioRuntimeProvider::default();
        let mut builder = match self.settings.nameserver {
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
            None => TokioResolver::builder(provider)
                .map_err(|e| Error::new("discovery.dns", format!("no system resolver: {e}")))?,
        };
        // prefixlb asks again every interval: that, not the record TTL, is how fresh it is.
        builder.options_mut().cache_size = 0;
        builder
            .build()
            .map_err(|e| Error::new("discovery.dns", format!("cannot build the resolver: {e}")))
    }

    async fn resolve(&mut self) -> Result<Vec<PeerSpec>, Error> {
        let c = &self.settings;
        let resolver = self.resolver()?;
        let fail = |e: hickory_resolver::net::NetError| {
            Error::new("discovery.dns.name", format!("resolving {}: {e}", c.name))
        };
        let peer = |addr, weight| PeerSpec {
            addr,
            weight,
            max_in_flight: c.max_in_flight,
            tls: c.tls.clone(),
            models: None,
        };
        let mut specs = Vec::new();
        match c.query {
            DnsQuery::A { port } => {
                let ips = resolver.lookup_ip(c.name.as_str()).await.map_err(fail)?;
                specs.extend(ips.iter().map(|ip| peer((ip, port).into(), c.weight)));
            }
            DnsQuery::Srv => {
                let lookup = resolver.srv_lookup(c.name.as_str()).await.map_err(fail)?;
                let mut last_error = None;
                let mut seen = HashMap::new();
                for record in lookup.answers() {
                    let RData::SRV(srv) = &record.data else {
                        continue;
                    };
                    // A target that does not resolve (a pod going away, a lookup lost) keeps
                    // its last good addresses for a few rounds, so that one failure moves no
                    // key; it is not a reason to ignore the others either.
                    let target = srv.target.to_string();
                    let known = self.targets.remove(&target);
                    let ips = match resolver.lookup_ip(target.as_str()).await {
                        Ok(ips) => (ips.iter().collect(), 0),
                        Err(e) => {
                            let kept =
                                known.filter(|(_, failed)| failed + 1 < c.failures_before_removal);
                            match kept {
                                Some((ips, failed)) => {
                                    log::warn!("{target} did not resolve ({e}): keeping its last addresses");
                                    (ips, failed + 1)
                                }
                                None => {
                                    last_error = Some(e);
                                    continue;
                                }
                            }
                        }
                    };
                    let weight = Weight::clamped(u64::from(srv.weight));
                    specs.extend(ips.0.iter().map(|&ip| peer((ip, srv.port).into(), weight)));
                    seen.insert(target, ips);
                }
                // Targets gone from the SRV answer are forgotten with it.
                self.targets = seen;
                if let (true, Some(e)) = (specs.is_empty(), last_error) {
                    return Err(fail(e));
                }
            }
        }
        Ok(specs)
    }
}
