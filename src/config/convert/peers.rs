//! The peers and where they come from, checked without looking anything up: a peer's name is
//! resolved afterwards, in `resolve`.

use super::values::{at_least_one, ceiling, millis, weight};
use crate::config::error::ConfigError;
use crate::config::paths::absolute;
use crate::config::schema::peers::{self as schema, DnsRecord, PortFile};
use crate::routing::Weight;
use crate::settings::{
    Discovery, Dns, DnsQuery, KubeApi, KubePort, KubeSelect, Kubernetes, Registry,
};

/// A peer whose values are checked and whose address is still as written.
#[derive(Debug)]
pub struct NamedPeer {
    /// `ip:port` or `host:port`.
    pub addr: String,
    pub weight: Weight,
    pub max_in_flight: u32,
    pub tls: Option<String>,
    pub models: Option<Vec<String>>,
}

/// `host` of `host:port` (an IPv6 address without its brackets).
fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    host.trim_start_matches('[').trim_end_matches(']')
}

pub fn peers(peers: &[schema::Peer]) -> Result<Vec<NamedPeer>, ConfigError> {
    peers
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let field = |name: &str| format!("peers[{i}].{name}");
            if p.sni.is_some() && !p.tls {
                return Err(ConfigError::new(
                    field("sni"),
                    "is for peers with tls: true",
                ));
            }
            Ok(NamedPeer {
                addr: p.addr.clone(),
                weight: weight(&field("weight"), p.weight)?,
                max_in_flight: ceiling(&field("max_in_flight"), p.max_in_flight)?,
                tls: p
                    .tls
                    .then(|| p.sni.clone().unwrap_or_else(|| host_of(&p.addr).to_owned())),
                models: p.models.clone(),
            })
        })
        .collect()
}

pub fn discovery(d: schema::DiscoveryFile, has_peers: bool) -> Result<Discovery, ConfigError> {
    let sources = [
        d.peers_file.is_some(),
        d.dns.is_some(),
        d.redis.is_some(),
        d.kubernetes.is_some(),
    ];
    if sources.iter().any(|&s| s) && has_peers {
        return Err(ConfigError::new(
            "peers",
            "must be empty when discovery.peers_file, dns, redis or kubernetes gives the peers",
        ));
    }
    if sources.iter().filter(|&&s| s).count() > 1 {
        return Err(ConfigError::new(
            "discovery",
            "peers_file, dns, redis and kubernetes are separate sources: choose one",
        ));
    }
    let interval = millis("discovery.reload_interval_ms", d.reload_interval_ms)?;
    if let Some(k) = d.kubernetes {
        return kubernetes(k).map(Discovery::Kubernetes);
    }
    if let Some(redis) = d.redis {
        return Ok(Discovery::Redis(Registry {
            url: redis.url,
            prefix: redis.prefix,
            interval: millis("discovery.redis.interval_ms", redis.interval_ms)?,
        }));
    }
    Ok(match (d.peers_file, d.dns) {
        // Both at once were refused above.
        (Some(path), _) => Discovery::PeersFile { path, interval },
        (None, Some(dns)) => Discovery::Dns(self::dns(dns)?),
        (None, None) => Discovery::ConfigFile { interval },
    })
}

fn dns(dns: schema::DnsFile) -> Result<Dns, ConfigError> {
    Ok(Dns {
        query: match (dns.record, dns.port) {
            (DnsRecord::A, Some(0)) => {
                return Err(ConfigError::new("discovery.dns.port", "must be at least 1"))
            }
            (DnsRecord::A, Some(port)) => DnsQuery::A { port },
            (DnsRecord::A, None) => {
                return Err(ConfigError::new(
                    "discovery.dns.port",
                    "is needed with A/AAAA records (SRV records carry their own)",
                ))
            }
            (DnsRecord::Srv, _) => DnsQuery::Srv,
        },
        interval: millis("discovery.dns.interval_ms", dns.interval_ms)?,
        weight: weight("discovery.dns.weight", dns.weight)?,
        max_in_flight: ceiling("discovery.dns.max_in_flight", dns.max_in_flight)?,
        tls: match (dns.tls, dns.sni) {
            (true, sni) => Some(sni.unwrap_or_else(|| dns.name.clone())),
            (false, None) => None,
            (false, Some(_)) => {
                return Err(ConfigError::new(
                    "discovery.dns.sni",
                    "is for peers with tls: true",
                ))
            }
        },
        failures_before_removal: {
            let n = dns.failures_before_removal;
            at_least_one("discovery.dns.failures_before_removal", n.into())?;
            n
        },
        nameserver: dns.nameserver,
        name: dns.name,
    })
}

fn kubernetes(k: schema::KubernetesFile) -> Result<Kubernetes, ConfigError> {
    let field = |name: &str| format!("discovery.kubernetes.{name}");
    let only_with = |set: bool, name: &str, with: &str| match set {
        true => Err(ConfigError::new(field(name), format!("is for {with}"))),
        false => Ok(()),
    };
    let non_empty = |name: &str, text: &Option<String>| match text {
        Some(t) if t.trim().is_empty() => Err(ConfigError::new(field(name), "is empty")),
        _ => Ok(()),
    };
    non_empty("namespace", &k.namespace)?;
    non_empty("service", &k.service)?;
    non_empty("selector", &k.selector)?;
    let select = match (k.service, k.selector) {
        (Some(name), None) => KubeSelect::Service(name),
        (None, Some(labels)) => KubeSelect::Labels(labels),
        (Some(_), Some(_)) => {
            return Err(ConfigError::new(
                field("selector"),
                "or service: one of them, not both",
            ))
        }
        (None, None) => {
            return Err(ConfigError::new(
                field("service"),
                "(a Service's name) or selector (a label selector) is needed",
            ))
        }
    };
    let port = match k.port {
        None => None,
        Some(PortFile::Number(0)) => {
            return Err(ConfigError::new(field("port"), "must be at least 1"))
        }
        Some(PortFile::Number(n)) => Some(KubePort::Number(n)),
        // A quoted number is a number: a port name always has a letter.
        Some(PortFile::Name(name)) => Some(match name.parse::<u16>() {
            Ok(n) if n > 0 => KubePort::Number(n),
            _ if name.trim().is_empty() => return Err(ConfigError::new(field("port"), "is empty")),
            _ => KubePort::Name(name),
        }),
    };
    let (no_file, no_api) = (k.kubeconfig.is_none(), k.api_server.is_none());
    only_with(k.context.is_some() && no_file, "context", "kubeconfig")?;
    only_with(k.token_file.is_some() && no_api, "token_file", "api_server")?;
    only_with(k.ca_file.is_some() && no_api, "ca_file", "api_server")?;
    let api = match (k.kubeconfig, k.api_server) {
        (None, None) => KubeApi::InCluster,
        (Some(path), None) => KubeApi::Kubeconfig {
            path: absolute(&path),
            context: k.context,
        },
        (None, Some(url)) => {
            let scheme = url.parse::<http::Uri>().ok().and_then(|u| {
                let s = u.scheme_str()?.to_owned();
                u.host()?;
                Some(s)
            });
            if !matches!(scheme.as_deref(), Some("https" | "http")) {
                return Err(ConfigError::new(
                    field("api_server"),
                    format!("`{url}` is not an https:// (or http://) URL"),
                ));
            }
            KubeApi::Server {
                url,
                token_file: k.token_file.as_deref().map(absolute),
                ca_file: k.ca_file.as_deref().map(absolute),
            }
        }
        (Some(_), Some(_)) => {
            return Err(ConfigError::new(
                field("api_server"),
                "or kubeconfig: one of them, not both",
            ))
        }
    };
    Ok(Kubernetes {
        api,
        namespace: k.namespace,
        select,
        port,
        interval: millis(&field("interval_ms"), k.interval_ms)?,
        weight: weight(&field("weight"), k.weight)?,
        max_in_flight: ceiling(&field("max_in_flight"), k.max_in_flight)?,
    })
}
