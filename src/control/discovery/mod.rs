//! Where the peer list comes from. Each source is a [`PeerSource`](source::PeerSource) in a
//! file of its own; a new one is that file and one line in [`build`].

pub mod dns;
pub mod file;
pub mod kubernetes;
pub mod redis;
pub mod source;

use std::path::Path;

use crate::error::Error;
use crate::settings::Discovery;
use dns::DnsSource;
use file::FileSource;
use kubernetes::KubernetesSource;
use redis::RegistrySource;
use source::PeerSource;

/// The source the settings name; `config_path` is prefixlb's own file, whose `peers` section
/// is the source when no other is named.
pub fn build(discovery: &Discovery, config_path: &Path) -> Result<Box<dyn PeerSource>, Error> {
    Ok(match discovery {
        Discovery::ConfigFile { interval } => {
            Box::new(FileSource::config_file(config_path, *interval))
        }
        Discovery::PeersFile { path, interval } => {
            Box::new(FileSource::peers_file(path, *interval))
        }
        Discovery::Dns(dns) => Box::new(DnsSource::new(dns)?),
        Discovery::Redis(registry) => Box::new(RegistrySource::new(registry)?),
        Discovery::Kubernetes(kubernetes) => Box::new(KubernetesSource::new(kubernetes)?),
    })
}
