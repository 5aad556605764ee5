//! Peers from DNS: A/AAAA records of one name with a port, or SRV records (target, port and
//! weight from each record; of the targets that resolve, those of the lowest priority, as RFC
//! 2782 has clients use the others only when none of those is there), asked again every
//! interval.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use async_trait::async_trait;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;

use super::source::{AtStart, PeerSource};
use crate::error::Error;
use crate::routing::{PeerSpec, Weight};
use crate::settings::{Dns, DnsQuery};

pub struct DnsSource {
    settings: Dns,
    /// Each SRV target's last good addresses, and how many rounds in a row it has failed since.
    targets: HashMap<String, (Vec<IpAddr>, u32)>,
}

impl DnsSource {
    pub fn new(settings: &Dns) -> Result<Self, Error> {
        let source = Self {
            settings: settings.clone(),
            targets: HashMap::new(),
        };
        // A resolver that cannot be built is a configuration error: say so at start.
        source.resolver()?;
        Ok(source)
    }

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
                // Each target's peers with its priority; the lowest that resolved serves.
                let mut by_priority: Vec<(u16, PeerSpec)> = Vec::new();
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
                    by_priority.extend(
                        ips.0
                            .iter()
                            .map(|&ip| (srv.priority, peer((ip, srv.port).into(), weight))),
                    );
                    seen.insert(target, ips);
                }
                let first = by_priority.iter().map(|(p, _)| *p).min();
                specs.extend(
                    by_priority
                        .into_iter()
                        .filter(|(p, _)| Some(*p) == first)
                        .map(|(_, spec)| spec),
                );
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

#[async_trait]
impl PeerSource for DnsSource {
    fn label(&self) -> String {
        format!("dns {}", self.settings.name)
    }

    fn interval(&self) -> Duration {
        self.settings.interval
    }

    fn at_start(&self) -> AtStart {
        AtStart::Tried
    }

    async fn peers(&mut self, _force: bool) -> Result<Option<Vec<PeerSpec>>, Error> {
        self.resolve().await.map(Some)
    }
}
