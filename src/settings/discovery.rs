//! Where the peers come from after start: prefixlb's own file, a peers file, DNS, a Redis
//! registry or Kubernetes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::routing::Weight;

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
    /// The EndpointSlices of Kubernetes Services, listed then watched.
    Kubernetes(Kubernetes),
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

/// Peers from the ready endpoints of EndpointSlices, each with the weight and ceiling its
/// slice's or Service's annotations give, else these.
#[derive(Debug, Clone, PartialEq)]
pub struct Kubernetes {
    pub api: KubeApi,
    /// `None`: the credentials' own (in a pod, the pod's namespace).
    pub namespace: Option<String>,
    pub select: KubeSelect,
    /// `None`: each slice's only port.
    pub port: Option<KubePort>,
    /// How often the control plane takes the watched set.
    pub interval: Duration,
    pub weight: Weight,
    /// [`crate::routing::UNLIMITED`] for no ceiling.
    pub max_in_flight: u32,
}

/// How the API server is reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeApi {
    /// The pod's service account: its token and CA under /var/run/secrets/kubernetes.io.
    InCluster,
    /// A kubeconfig file, at its current context or this one.
    Kubeconfig {
        path: PathBuf,
        context: Option<String>,
    },
    /// An explicit server, e.g. from outside the cluster.
    Server {
        url: String,
        token_file: Option<PathBuf>,
        ca_file: Option<PathBuf>,
    },
}

/// Which EndpointSlices (and Services, for their annotations).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubeSelect {
    /// One Service by name.
    Service(String),
    /// The Services a label selector matches: their slices carry their labels.
    Labels(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KubePort {
    /// The slice port of this name.
    Name(String),
    /// This port on every address, whatever the slices say.
    Number(u16),
}

impl Kubernetes {
    /// Taking the watched set is a look at memory: often enough that a change is seen at once.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(250);
}
