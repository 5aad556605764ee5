//! Where the peer list comes from, and reading it again.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;

use crate::config::{self, ConfigError};
use crate::routing::{PeerSpec, Weight};
use crate::settings::{Discovery, Dns, DnsQuery};

pub enum PeerSource {
    /// The `peers` section of prefixlb's own file.
    ConfigFile(FileSource),
    /// A file of its own.
    PeersFile(FileSource),
    Dns(DnsSource),
}

pub struct FileSource {
    path: PathBuf,
    /// What the file held when it was last read, so that an unchanged file is not parsed, and
    /// the inode it was read from.
    last: Option<(String, u64)>,
    interval: Duration,
}

pub struct DnsSource {
    settings: Dns,
    /// Each SRV target's last good addresses, and how many rounds in a row it has failed since.
    targets: HashMap<String, (Vec<IpAddr>, u32)>,
}

impl PeerSource {
    pub fn new(discovery: &Discovery, config_path: &Path) -> Result<Self, ConfigError> {
        let file = |path: &Path, interval: Duration| FileSource {
            path: path.to_owned(),
            last: None,
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
            PeerSource::ConfigFile(f) | PeerSource::PeersFile(f) => f.path.display().to_string(),
            PeerSource::Dns(d) => format!("dns {}", d.settings.name),
        }
    }

    pub fn interval(&self) -> Duration {
        match self {
            PeerSource::ConfigFile(f) | PeerSource::PeersFile(f) => f.interval,
            PeerSource::Dns(d) => d.settings.interval,
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
                config::parse(&text).map(|s| s.peers)
            } else {
                config::parse_peers_file(&text)
            }
        })
        .await
        .map_err(|e| ConfigError::new("", format!("reading the peers failed: {e}")))?;
        parsed.map(Some)
    }
}

/// How long a file changed in place must stay as it is before it is read as the new list: a
/// writer that does not write-then-rename is caught mid-write otherwise.
const SETTLE: Duration = Duration::from_millis(200);

impl FileSource {
    /// The file's text and inode.
    async fn read(&self) -> Result<(String, u64), ConfigError> {
        let fail = |e: std::io::Error| {
            ConfigError::new("", format!("cannot read {}: {e}", self.path.display()))
        };
        let meta = tokio::fs::metadata(&self.path).await.map_err(fail)?;
        let text = tokio::fs::read_to_string(&self.path).await.map_err(fail)?;
        Ok((text, std::os::unix::fs::MetadataExt::ino(&meta)))
    }

    async fn changed(&mut self, force: bool) -> Result<Option<String>, ConfigError> {
        let read = self.read().await?;
        let in_place = match &self.last {
            Some((text, _)) if !force && *text == read.0 => return Ok(None),
            Some((_, inode)) => *inode == read.1,
            // The first read may meet a writer mid-write as well as any later one.
            None => true,
        };
        // A file put in place by a rename is whole; one rewritten in place (or met for the
        // first time) may still be growing.
        if in_place {
            tokio::time::sleep(SETTLE).await;
            if self.read().await?.0 != read.0 {
                log::debug!(
                    "{} is being written: read again at the next check",
                    self.path.display()
                );
                return Ok(None);
            }
        }
        let text = read.0.clone();
        self.last = Some(read);
        Ok(Some(text))
    }
}

impl DnsSource {
    /// A resolver for one round of lookups. Its sockets belong to the runtime it is built on,
    /// and the first load runs on another runtime than the control plane: a resolver per round
    /// keeps each on its own.
    fn resolver(&self) -> Result<TokioResolver, ConfigError> {
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
            None => TokioResolver::builder(provider).map_err(|e| {
                ConfigError::new("discovery.dns", format!("no system resolver: {e}"))
            })?,
        };
        // prefixlb asks again every interval: that, not the record TTL, is how fresh it is.
        builder.options_mut().cache_size = 0;
        builder.build().map_err(|e| {
            ConfigError::new("discovery.dns", format!("cannot build the resolver: {e}"))
        })
    }

    async fn resolve(&mut self) -> Result<Vec<PeerSpec>, ConfigError> {
        let c = &self.settings;
        let resolver = self.resolver()?;
        let fail = |e: hickory_resolver::net::NetError| {
            ConfigError::new("discovery.dns.name", format!("resolving {}: {e}", c.name))
        };
        let peer = |addr, weight| PeerSpec {
            addr,
            weight,
            max_in_flight: c.max_in_flight,
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
