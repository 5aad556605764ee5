//! Typed builders for the two files the real binary reads: prefixlb's configuration and
//! Pingora's settings. Each key a test or benchmark sets is named here, once; the spawner
//! inspects the value built (are listeners set? engine metrics?) and serialises it itself.

use std::borrow::Borrow;
use std::fmt::Display;
use std::net::SocketAddr;
use std::path::Path;

use serde_yaml::{Mapping, Value};

use super::Upstream;

mod discovery;
mod health;
mod pingora_config;
mod replica;
mod requests;
mod routing;

// Not every test binary starts replicas or sets Pingora's own settings.
#[allow(unused_imports)]
pub use {pingora_config::*, replica::*};

/// Sets `value` at `path` (sections, then the key) in `map`, making the sections it lacks.
fn set(map: &mut Mapping, path: &[&str], value: Value) {
    let (key, sections) = path.split_last().expect("a key");
    let mut at = map;
    for section in sections {
        at = at
            .entry(Value::from(*section))
            .or_insert_with(|| Value::Mapping(Mapping::new()))
            .as_mapping_mut()
            .unwrap_or_else(|| panic!("`{section}` is set to a value, not a section"));
    }
    at.insert(Value::from(*key), value);
}

/// Appends `item` to the list at the top-level `key`.
fn push(map: &mut Mapping, key: &str, item: Value) {
    map.entry(Value::from(key))
        .or_insert_with(|| Value::Sequence(Vec::new()))
        .as_sequence_mut()
        .unwrap_or_else(|| panic!("`{key}` is not a list"))
        .push(item);
}

fn text(value: impl Display) -> Value {
    Value::from(value.to_string())
}

fn list(items: &[&str]) -> Value {
    Value::Sequence(items.iter().map(|s| Value::from(*s)).collect())
}

/// One entry of the `peers:` list.
#[derive(Clone, Debug)]
pub struct PeerEntry(Mapping);

impl PeerEntry {
    pub fn at(addr: impl Display) -> Self {
        let mut map = Mapping::new();
        set(&mut map, &["addr"], text(addr));
        Self(map)
    }

    pub fn max_in_flight(mut self, n: u32) -> Self {
        set(&mut self.0, &["max_in_flight"], n.into());
        self
    }

    pub fn weight(mut self, w: u32) -> Self {
        set(&mut self.0, &["weight"], w.into());
        self
    }

    /// The models it is listed as serving.
    pub fn models(mut self, models: &[&str]) -> Self {
        set(&mut self.0, &["models"], list(models));
        self
    }

    /// Spoken to over TLS, with `sni` as the server name.
    pub fn tls(mut self, sni: &str) -> Self {
        set(&mut self.0, &["tls"], true.into());
        set(&mut self.0, &["sni"], sni.into());
        self
    }
}

/// prefixlb's configuration, built by one typed method per setting.
#[derive(Clone, Debug, Default)]
pub struct TestConfig(Mapping);

impl TestConfig {
    pub fn new() -> Self {
        Self::default()
    }

    fn set(mut self, path: &[&str], value: impl Into<Value>) -> Self {
        set(&mut self.0, path, value.into());
        self
    }

    fn has(&self, key: &str) -> bool {
        self.0.contains_key(key)
    }

    /// The YAML text of this configuration.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(&self.0).unwrap()
    }

    // Peers.

    /// The `peers:` list alone is also what a peers file holds.
    pub fn peer(mut self, peer: PeerEntry) -> Self {
        push(&mut self.0, "peers", Value::Mapping(peer.0));
        self
    }

    pub fn peers<U: Borrow<Upstream>>(self, ups: &[U]) -> Self {
        self.peers_at(ups.iter().map(|u| u.borrow().addr))
    }

    pub fn peers_at(self, addrs: impl IntoIterator<Item = SocketAddr>) -> Self {
        addrs
            .into_iter()
            .fold(self, |config, addr| config.peer(PeerEntry::at(addr)))
    }

    /// `max_in_flight` on every peer listed so far.
    pub fn max_in_flight(mut self, n: u32) -> Self {
        let peers = self
            .0
            .get_mut("peers")
            .and_then(Value::as_sequence_mut)
            .expect("peers are listed before their max_in_flight");
        for peer in peers {
            set(peer.as_mapping_mut().unwrap(), &["max_in_flight"], n.into());
        }
        self
    }

    // Listeners and the admin API.

    pub fn has_listeners(&self) -> bool {
        self.has("listen")
    }

    pub fn listen_on(mut self, addr: SocketAddr) -> Self {
        push(&mut self.0, "listen", text(addr));
        self
    }

    /// A TLS listener on the proxy's own port: the spawner gives it its address.
    pub fn listen_tls(mut self, cert: &Path, key: &Path) -> Self {
        let mut listener = Mapping::new();
        set(&mut listener, &["tls", "cert"], text(cert.display()));
        set(&mut listener, &["tls", "key"], text(key.display()));
        push(&mut self.0, "listen", Value::Mapping(listener));
        self
    }

    /// Gives `addr` to every listener set without an address.
    pub(super) fn address_listeners(mut self, addr: SocketAddr) -> Self {
        let listeners = self.0.get_mut("listen").and_then(Value::as_sequence_mut);
        for listener in listeners.into_iter().flatten() {
            if let Some(l) = listener.as_mapping_mut() {
                if !l.contains_key("addr") {
                    set(l, &["addr"], text(addr));
                }
            }
        }
        self
    }

    pub fn admin_on(self, addr: SocketAddr) -> Self {
        self.set(&["admin", "listen"], text(addr))
    }

    pub fn no_admin(self) -> Self {
        self.set(&["admin", "listen"], Value::Null)
    }

    pub fn admin_token(self, token: &str) -> Self {
        self.set(&["admin", "token"], token)
    }

    pub fn h2c(self) -> Self {
        self.set(&["h2c"], true)
    }
}
