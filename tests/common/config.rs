//! Typed builders for the two files the real binary reads: prefixlb's configuration and
//! Pingora's settings. Each key a test or benchmark sets is named here, once; the spawner
//! inspects the value built (are listeners set? engine metrics?) and serialises it itself.

use std::borrow::Borrow;
use std::fmt::Display;
use std::net::SocketAddr;
use std::path::Path;

use serde_yaml::{Mapping, Value};

use super::Upstream;

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

/// What one of several prefixlb processes that tell each other where prompts went is told:
/// the UDP address it listens on and those of the others.
#[derive(Clone, Debug)]
pub struct Replica {
    pub listen: SocketAddr,
    pub others: Vec<SocketAddr>,
}

/// The replica settings of `n` processes, on loopback UDP ports free when looked up.
pub fn replicas(n: usize) -> Vec<Replica> {
    // All held until all are known, so that no two are the same.
    let sockets: Vec<_> = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = sockets.iter().map(|s| s.local_addr().unwrap()).collect();
    addrs
        .iter()
        .map(|&listen| Replica {
            listen,
            others: addrs.iter().copied().filter(|a| *a != listen).collect(),
        })
        .collect()
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

    // Engine metrics and health.

    pub fn has_engine_metrics(&self) -> bool {
        self.has("engine_metrics")
    }

    pub fn engine_metrics(self, enabled: bool) -> Self {
        self.set(&["engine_metrics", "enabled"], enabled)
    }

    pub fn engine_metrics_interval_ms(self, ms: u64) -> Self {
        self.set(&["engine_metrics", "interval_ms"], ms)
    }

    pub fn no_health_check(self) -> Self {
        self.set(&["health_check", "enabled"], false)
    }

    pub fn health_check_interval_ms(self, ms: u64) -> Self {
        self.set(&["health_check", "interval_ms"], ms)
    }

    pub fn health_check_timeout_ms(self, ms: u64) -> Self {
        self.set(&["health_check", "timeout_ms"], ms)
    }

    pub fn healthy_after(self, n: u32) -> Self {
        self.set(&["health_check", "healthy_after"], n)
    }

    pub fn unhealthy_after(self, n: u32) -> Self {
        self.set(&["health_check", "unhealthy_after"], n)
    }

    pub fn consecutive_failures(self, n: u32) -> Self {
        self.set(&["outlier", "consecutive_failures"], n)
    }

    /// The first ejection's length and the longest one's.
    pub fn ejection_ms(self, base: u64, max: u64) -> Self {
        self.set(&["outlier", "base_ejection_ms"], base)
            .set(&["outlier", "max_ejection_ms"], max)
    }

    pub fn max_ejected_percent(self, percent: u32) -> Self {
        self.set(&["outlier", "max_ejected_percent"], percent)
    }

    // Routing.

    pub fn policy(self, name: &str) -> Self {
        self.set(&["routing", "policy"], name)
    }

    /// `None` lifts the bound (null).
    pub fn balance_factor(self, factor: Option<f64>) -> Self {
        self.set(
            &["routing", "balance_factor"],
            factor.map_or(Value::Null, Value::from),
        )
    }

    pub fn prefill_tokens_per_second(self, rate: f64) -> Self {
        self.set(&["routing", "prefill_tokens_per_second"], rate)
    }

    pub fn shared_prefix_placement(self, on: bool) -> Self {
        self.set(&["routing", "shared_prefix_placement"], on)
    }

    /// `advanced.<key>`: one figure of the tuning, written as YAML.
    pub fn advanced(self, key: &str, yaml: &str) -> Self {
        let value: Value = serde_yaml::from_str(yaml).expect("a YAML value");
        self.set(&["advanced", key], value)
    }

    pub fn prefix_record_mib(self, mib: u64) -> Self {
        self.set(&["routing", "prefix_record_mib"], mib)
    }

    pub fn peek_limit_bytes(self, bytes: u64) -> Self {
        self.set(&["routing", "peek_limit_bytes"], bytes)
    }

    pub fn peek_timeout_ms(self, ms: u64) -> Self {
        self.set(&["routing", "peek_timeout_ms"], ms)
    }

    pub fn chat_path(self, path: &str) -> Self {
        self.set(&["routing", "key", "chat_path"], path)
    }

    pub fn replica(self, replica: &Replica) -> Self {
        let others: Vec<Value> = replica.others.iter().map(text).collect();
        self.set(&["replicas", "listen"], text(replica.listen))
            .set(&["replicas", "others"], Value::Sequence(others))
    }

    /// `replicas.key_file`: the keys the replicas sign their datagrams with.
    pub fn replica_key_file(self, path: &Path) -> Self {
        self.set(&["replicas", "key_file"], text(path.display()))
    }

    /// `tracing`: spans sent to the OTLP/HTTP traces URL `endpoint`, as `service_name`.
    pub fn tracing(self, endpoint: &str, service_name: &str) -> Self {
        self.set(&["tracing", "otlp_endpoint"], endpoint)
            .set(&["tracing", "service_name"], service_name)
    }

    // Requests: the queue, limits, upstream connections, forwarding, the access log, keys.

    pub fn max_waiting(self, n: u32) -> Self {
        self.set(&["queue", "max_waiting"], n)
    }

    pub fn queue_timeout_ms(self, ms: u64) -> Self {
        self.set(&["queue", "timeout_ms"], ms)
    }

    pub fn max_body_bytes(self, bytes: u64) -> Self {
        self.set(&["limits", "max_body_bytes"], bytes)
    }

    pub fn client_write_timeout_ms(self, ms: u64) -> Self {
        self.set(&["limits", "client_write_timeout_ms"], ms)
    }

    pub fn peek_memory_bytes(self, bytes: u64) -> Self {
        self.set(&["limits", "peek_memory_bytes"], bytes)
    }

    pub fn connect_retries(self, n: u32) -> Self {
        self.set(&["upstream", "connect_retries"], n)
    }

    pub fn read_timeout_ms(self, ms: u64) -> Self {
        self.set(&["upstream", "read_timeout_ms"], ms)
    }

    pub fn wedge_after_ms(self, ms: u64) -> Self {
        self.set(&["upstream", "wedge_after_ms"], ms)
    }

    pub fn stream_idle_timeout_ms(self, ms: u64) -> Self {
        self.set(&["upstream", "stream_idle_timeout_ms"], ms)
    }

    /// The CA that engines spoken to over TLS are checked against.
    pub fn upstream_ca_file(self, path: &Path) -> Self {
        self.set(&["upstream", "tls", "ca_file"], text(path.display()))
    }

    pub fn trusted_proxies(self, cidrs: &[&str]) -> Self {
        self.set(&["forwarding", "trusted_proxies"], list(cidrs))
    }

    /// No path allowlist: every path is forwarded (null).
    pub fn forward_every_path(self) -> Self {
        self.set(&["forwarding", "allowed_paths"], Value::Null)
    }

    /// `plain`, `json` or `off`.
    pub fn access_log(self, format: &str) -> Self {
        self.set(&["access_log"], format)
    }

    pub fn keys_file(self, path: &Path) -> Self {
        self.set(&["auth", "keys_file"], text(path.display()))
    }

    /// Engines see the client's API key.
    pub fn forward_key(self) -> Self {
        self.set(&["auth", "forward_key"], true)
    }

    // Where peers come from besides the list.

    pub fn peers_file(self, path: &Path) -> Self {
        self.set(&["discovery", "peers_file"], text(path.display()))
    }

    pub fn reload_interval_ms(self, ms: u64) -> Self {
        self.set(&["discovery", "reload_interval_ms"], ms)
    }

    pub fn allow_empty(self, allow: bool) -> Self {
        self.set(&["discovery", "allow_empty"], allow)
    }

    /// Peers from the A records of `name`, asked of `nameserver`.
    pub fn dns(self, name: &str, nameserver: SocketAddr) -> Self {
        self.set(&["discovery", "dns", "name"], name)
            .set(&["discovery", "dns", "nameserver"], text(nameserver))
    }

    /// Peers from `name`'s SRV records rather than its A records.
    pub fn dns_srv(self) -> Self {
        self.set(&["discovery", "dns", "record"], "srv")
    }

    pub fn dns_port(self, port: u16) -> Self {
        self.set(&["discovery", "dns", "port"], port)
    }

    pub fn dns_interval_ms(self, ms: u64) -> Self {
        self.set(&["discovery", "dns", "interval_ms"], ms)
    }

    pub fn dns_max_in_flight(self, n: u32) -> Self {
        self.set(&["discovery", "dns", "max_in_flight"], n)
    }

    pub fn dns_failures_before_removal(self, n: u32) -> Self {
        self.set(&["discovery", "dns", "failures_before_removal"], n)
    }

    pub fn redis(self, url: &str, interval_ms: u64) -> Self {
        self.set(&["discovery", "redis", "url"], url)
            .set(&["discovery", "redis", "interval_ms"], interval_ms)
    }

    /// Peers from the EndpointSlices of `service` in `namespace`, asked of the API server at
    /// `url` with the bearer token in `token_file`, taken every 50 ms.
    pub fn kubernetes(self, url: &str, token_file: &Path, namespace: &str, service: &str) -> Self {
        let key = |k| ["discovery", "kubernetes", k];
        self.set(&key("api_server"), url)
            .set(&key("token_file"), text(token_file.display()))
            .set(&key("namespace"), namespace)
            .set(&key("service"), service)
            .set(&key("interval_ms"), 50)
    }

    /// The slice port of this name (or number, written as one).
    pub fn kubernetes_port(self, port: &str) -> Self {
        self.set(&["discovery", "kubernetes", "port"], port)
    }

    /// Peers are asked what models they serve, every `interval_ms`.
    pub fn discover_models(self, interval_ms: u64) -> Self {
        self.set(&["models", "discover"], true)
            .set(&["models", "interval_ms"], interval_ms)
    }

    pub fn default_model(self, model: &str) -> Self {
        self.set(&["models", "default"], model)
    }
}

/// Pingora's own settings.
#[derive(Clone, Debug)]
pub struct PingoraConfig(Mapping);

impl Default for PingoraConfig {
    fn default() -> Self {
        let mut map = Mapping::new();
        set(&mut map, &["version"], 1.into());
        Self(map)
    }
}

impl PingoraConfig {
    pub fn new() -> Self {
        Self::default()
    }

    fn set(mut self, key: &str, value: impl Into<Value>) -> Self {
        set(&mut self.0, &[key], value.into());
        self
    }

    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(&self.0).unwrap()
    }

    pub fn has_threads(&self) -> bool {
        self.0.contains_key("threads")
    }

    pub fn threads(self, n: u32) -> Self {
        self.set("threads", n)
    }

    /// How long an old process keeps serving after an upgrade or a graceful stop, and how long
    /// its final shutdown may take.
    pub fn grace_seconds(self, period: u64, shutdown_timeout: u64) -> Self {
        self.set("grace_period_seconds", period)
            .set("graceful_shutdown_timeout_seconds", shutdown_timeout)
    }

    pub fn pid_file(self, path: &Path) -> Self {
        self.set("pid_file", text(path.display()))
    }

    pub fn upgrade_sock(self, path: &Path) -> Self {
        self.set("upgrade_sock", text(path.display()))
    }
}
