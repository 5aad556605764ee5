//! prefixlb's settings for where peers come from besides the `peers:` list (a peers file, DNS,
//! Redis, Kubernetes) and for the models they serve.

use std::net::SocketAddr;
use std::path::Path;

use super::{text, TestConfig};

impl TestConfig {
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
