//! prefixlb's settings for the requests it serves: the queue, limits, upstream connections,
//! forwarding, the access log and API keys.

use std::path::Path;

use serde_yaml::Value;

use super::{list, text, TestConfig};

impl TestConfig {
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

    pub fn client_header_timeout_ms(self, ms: u64) -> Self {
        self.set(&["proxy", "client_header_timeout_ms"], ms)
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
}
