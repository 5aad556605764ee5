//! Every value of the file checked, without touching anything outside it: the settings but
//! what `resolve` completes afterwards (peer addresses, the CA, files made absolute).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::peers::{self, NamedPeer};
use super::proxy::proxy;
use super::router::router;
use super::traces::traces;
use super::values::{at_least_one, millis, path, socket_addr};
use crate::config::error::ConfigError;
use crate::config::schema::engines::{EngineMetricsFile, HealthCheck, ModelsFile};
use crate::config::schema::{self, File};
use crate::settings::{
    AdminSettings, Auth, EngineMetrics, Listener, ModelDiscovery, Replicas, Settings, TlsFiles,
};

/// Checked settings and what is still to be looked up. In `settings`, `peers` is empty, the
/// upstream CA is unread, and the listeners' and keys' files are paths as written.
pub struct Checked {
    pub settings: Settings,
    pub peers: Vec<NamedPeer>,
    pub ca_file: Option<PathBuf>,
}

pub fn check(f: File) -> Result<Checked, ConfigError> {
    let listen = listeners(&f.listen)?;
    let auth = f.auth.as_ref().map(|a| Auth {
        keys_file: a.keys_file.clone(),
        forward_key: a.forward_key,
    });
    let named = peers::peers(&f.peers)?;
    let router = router(&f.routing, &f.endpoints, &f.outlier, &f.advanced)?;
    let proxy = proxy(&f)?;
    let has_peers = !f.peers.is_empty();
    let admin = admin(f.admin, &listen)?;
    let settings = Settings {
        listen,
        h2c: f.h2c,
        auth,
        router,
        proxy,
        admin,
        allow_empty_peers: f.discovery.allow_empty,
        discovery: peers::discovery(f.discovery, has_peers)?,
        health_check: health_check(f.health_check)?,
        engine_metrics: engine_metrics(f.engine_metrics)?,
        model_discovery: model_discovery(&f.models)?,
        replicas: f.replicas.map(replicas).transpose()?,
        tracing: f.tracing.map(traces).transpose()?,
        peers: Vec::new(),
    };
    Ok(Checked {
        settings,
        peers: named,
        ca_file: f.upstream.tls.ca_file,
    })
}

fn listeners(listen: &[schema::Listen]) -> Result<Vec<Listener>, ConfigError> {
    if listen.is_empty() {
        return Err(ConfigError::new("listen", "at least one address is needed"));
    }
    let mut out: Vec<Listener> = Vec::with_capacity(listen.len());
    for (i, l) in listen.iter().enumerate() {
        let field = format!("listen[{i}]");
        let listener = match l {
            schema::Listen::Addr(addr) => Listener {
                addr: socket_addr(&field, addr)?,
                tls: None,
            },
            schema::Listen::Full(full) => Listener {
                addr: socket_addr(&format!("{field}.addr"), &full.addr)?,
                tls: full.tls.as_ref().map(|tls| TlsFiles {
                    cert: tls.cert.clone(),
                    key: tls.key.clone(),
                }),
            },
        };
        if let Some(other) = out.iter().find(|o| clash(o.addr, listener.addr)) {
            return Err(ConfigError::new(
                field,
                format!(
                    "{} takes the port of {} listed before it",
                    listener.addr, other.addr
                ),
            ));
        }
        out.push(listener);
    }
    Ok(out)
}

/// Whether two listeners cannot both bind: the same port on the same address, or beside a
/// wildcard of the same family (`[::]` takes IPv4 too: Linux binds it dual-stack). Found here,
/// not by the bind in a service's own task, which would leave the process running without that
/// service.
fn clash(a: SocketAddr, b: SocketAddr) -> bool {
    let covers =
        |w: SocketAddr, o: SocketAddr| w.ip().is_unspecified() && (w.is_ipv6() || o.is_ipv4());
    a.port() == b.port() && (a.ip() == b.ip() || covers(a, b) || covers(b, a))
}

fn admin(a: schema::Admin, proxies: &[Listener]) -> Result<Option<AdminSettings>, ConfigError> {
    let Some(listen) = a.listen else {
        return Ok(None);
    };
    if a.token.as_deref() == Some("") {
        return Err(ConfigError::new(
            "admin.token",
            "must not be empty (omit it for none)",
        ));
    }
    let listen = socket_addr("admin.listen", &listen)?;
    if let Some(proxy) = proxies.iter().find(|p| clash(p.addr, listen)) {
        return Err(ConfigError::new(
            "admin.listen",
            format!("{listen} takes the port of the proxy's {}", proxy.addr),
        ));
    }
    if !listen.ip().is_loopback() && a.token.is_none() {
        return Err(ConfigError::new(
            "admin.listen",
            format!("{listen} is not loopback: set admin.token, since the admin API can drain every peer"),
        ));
    }
    Ok(Some(AdminSettings {
        listen,
        token: a.token,
    }))
}

fn replicas(r: schema::ReplicasFile) -> Result<Replicas, ConfigError> {
    if r.others.is_empty() {
        return Err(ConfigError::new(
            "replicas.others",
            "lists no other process (omit replicas for none)",
        ));
    }
    let replicas = Replicas {
        listen: socket_addr("replicas.listen", &r.listen)?,
        others: r
            .others
            .iter()
            .enumerate()
            .map(|(i, o)| socket_addr(&format!("replicas.others[{i}]"), o))
            .collect::<Result<_, _>>()?,
        key_file: r.key_file,
    };
    // Off loopback, anyone who reaches the port, or sends from a replica's address, could
    // steer keys to the peers of their choice.
    let exposed = std::iter::once(&replicas.listen)
        .chain(&replicas.others)
        .find(|a| !a.ip().to_canonical().is_loopback());
    if let (Some(addr), None) = (exposed, &replicas.key_file) {
        return Err(ConfigError::new(
            "replicas.key_file",
            format!("required: {addr} is not loopback, and unsigned datagrams from another host could steer keys (see docs/operations.md for making a key)"),
        ));
    }
    Ok(replicas)
}

fn health_check(h: HealthCheck) -> Result<Option<crate::settings::HealthCheck>, ConfigError> {
    path("health_check.path", &h.path)?;
    at_least_one("health_check.healthy_after", h.healthy_after as u64)?;
    at_least_one("health_check.unhealthy_after", h.unhealthy_after as u64)?;
    let check = crate::settings::HealthCheck {
        interval: millis("health_check.interval_ms", h.interval_ms)?,
        timeout: millis("health_check.timeout_ms", h.timeout_ms)?,
        healthy_after: h.healthy_after,
        unhealthy_after: h.unhealthy_after,
        path: h.path,
    };
    Ok(h.enabled.then_some(check))
}

fn engine_metrics(e: EngineMetricsFile) -> Result<Option<EngineMetrics>, ConfigError> {
    path("engine_metrics.path", &e.path)?;
    let metrics = EngineMetrics {
        interval: millis("engine_metrics.interval_ms", e.interval_ms)?,
        timeout: millis("engine_metrics.timeout_ms", e.timeout_ms)?,
        path: e.path,
    };
    Ok(e.enabled.then_some(metrics))
}

fn model_discovery(m: &ModelsFile) -> Result<Option<ModelDiscovery>, ConfigError> {
    if !m.discover {
        return Ok(None);
    }
    let interval = millis("models.interval_ms", m.interval_ms)?;
    Ok(Some(ModelDiscovery {
        interval,
        timeout: interval.min(Duration::from_secs(2)),
    }))
}
