//! The one place the configuration reaches outside itself, after every value was checked:
//! peer names resolved, the files it names found, the upstream CA read.

use std::net::ToSocketAddrs;
use std::path::{Path, PathBuf};

use super::check::Checked;
use super::peers::NamedPeer;
use crate::config::error::ConfigError;
use crate::config::paths::absolute;
use crate::routing::PeerSpec;
use crate::settings::Settings;

pub fn resolve(checked: Checked) -> Result<Settings, ConfigError> {
    let mut settings = checked.settings;
    for (i, listener) in settings.listen.iter_mut().enumerate() {
        if let Some(tls) = &mut listener.tls {
            tls.cert = existing_file(&format!("listen[{i}].tls.cert"), &tls.cert)?;
            tls.key = existing_file(&format!("listen[{i}].tls.key"), &tls.key)?;
        }
    }
    if let Some(auth) = &mut settings.auth {
        auth.keys_file = existing_file("auth.keys_file", &auth.keys_file)?;
    }
    if let Some(key_file) = settings.replicas.as_mut().and_then(|r| r.key_file.as_mut()) {
        *key_file = existing_file("replicas.key_file", key_file)?;
    }
    if let Some(path) = &checked.ca_file {
        let pem = std::fs::read(absolute(path)).map_err(|e| {
            ConfigError::new("upstream.tls.ca_file", format!("{}: {e}", path.display()))
        })?;
        settings.proxy.upstream.tls.ca = Some(crate::tls::ca_bundle(&pem)?);
    }
    settings.peers = peers(&checked.peers)?;
    Ok(settings)
}

/// A file named in the configuration, as an absolute path, kept as written otherwise: a
/// symlink is followed at each read, as certbot's `live/` links and Kubernetes' secret mounts
/// are renewed by repointing them.
fn existing_file(field: &str, path: &Path) -> Result<PathBuf, ConfigError> {
    let path = absolute(path);
    std::fs::metadata(&path)
        .map_err(|e| ConfigError::new(field, format!("{}: {e}", path.display())))?;
    Ok(path)
}

/// The peers as the routing core takes them; hostnames are resolved here, once.
pub fn peers(named: &[NamedPeer]) -> Result<Vec<PeerSpec>, ConfigError> {
    let mut specs: Vec<PeerSpec> = Vec::with_capacity(named.len());
    for (i, p) in named.iter().enumerate() {
        let field = format!("peers[{i}].addr");
        let addr = p
            .addr
            .to_socket_addrs()
            .map_err(|e| ConfigError::new(&field, format!("`{}`: {e}", p.addr)))?
            .next()
            .ok_or_else(|| ConfigError::new(&field, format!("`{}` resolves to nothing", p.addr)))?;
        if specs.iter().any(|s| s.addr == addr) {
            return Err(ConfigError::new(field, format!("{addr} is listed twice")));
        }
        specs.push(PeerSpec {
            addr,
            weight: p.weight,
            max_in_flight: p.max_in_flight,
            tls: p.tls.clone(),
            models: p.models.clone(),
        });
    }
    Ok(specs)
}
