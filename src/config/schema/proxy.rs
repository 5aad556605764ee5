//! What the proxy does with a request of its own: `proxy` (body limits, the key's peek),
//! `queue`, `upstream`, `forwarding` and `access_log`.

use std::path::PathBuf;

use serde::Deserialize;

use super::defaults::ms;
use crate::routing::QueueLimit;
use crate::settings::AccessLogFormat;
use crate::settings::{self, ForwardingSettings, PeekLimits, ProxySettings};

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Proxy {
    pub max_body_bytes: usize,
    /// Longest a write to the client may block before its stream is ended.
    pub client_write_timeout_ms: u64,
    /// Longest a request's head may take to arrive, from its first byte.
    pub client_header_timeout_ms: u64,
    /// The model of a request that names none.
    pub default_model: Option<String>,
    pub peek: Peek,
}

impl Default for Proxy {
    fn default() -> Self {
        Self {
            max_body_bytes: PeekLimits::default().max_body,
            client_write_timeout_ms: ms(ProxySettings::DEFAULT_CLIENT_WRITE_TIMEOUT),
            client_header_timeout_ms: ms(ProxySettings::DEFAULT_CLIENT_HEADER_TIMEOUT),
            default_model: None,
            peek: Peek::default(),
        }
    }
}

/// Reading the start of a prompt-carrying body to find its key.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Peek {
    /// How much of a body is read, at most.
    pub limit_bytes: usize,
    /// How long reading it may take in all.
    pub timeout_ms: u64,
    /// Body bytes that all requests together may hold while their keys are read.
    pub memory_bytes: usize,
}

impl Default for Peek {
    fn default() -> Self {
        let p = PeekLimits::default();
        Self {
            limit_bytes: p.peek_limit,
            timeout_ms: ms(p.deadline),
            memory_bytes: p.memory,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Queue {
    /// Requests that may wait for a slot when every peer is at its bound; 0 rejects at once.
    pub max_waiting: usize,
    pub timeout_ms: u64,
}

impl Default for Queue {
    fn default() -> Self {
        let q = QueueLimit::default();
        Self {
            max_waiting: q.max_waiting,
            timeout_ms: ms(q.timeout),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Upstream {
    pub connect_timeout_ms: u64,
    pub read_timeout_ms: u64,
    pub write_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    pub connect_retries: usize,
    pub wedge_after_ms: u64,
    pub stream_idle_timeout_ms: u64,
    pub tls: UpstreamTlsFile,
}

impl Default for Upstream {
    fn default() -> Self {
        let u = settings::Upstream::default();
        Self {
            connect_timeout_ms: ms(u.connect_timeout),
            read_timeout_ms: ms(u.read_timeout),
            write_timeout_ms: ms(u.write_timeout),
            idle_timeout_ms: ms(u.idle_timeout),
            connect_retries: u.connect_retries,
            wedge_after_ms: ms(u.wedge_after),
            stream_idle_timeout_ms: ms(u.stream_idle_timeout),
            tls: UpstreamTlsFile::default(),
        }
    }
}

/// How engines reached over TLS are checked.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UpstreamTlsFile {
    /// CA certificates to trust (PEM); the system's when absent.
    pub ca_file: Option<PathBuf>,
    pub verify: bool,
}

impl Default for UpstreamTlsFile {
    fn default() -> Self {
        Self {
            ca_file: None,
            verify: settings::UpstreamTls::default().verify,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Forwarding {
    /// Networks (`10.0.0.0/8`, or one address) of proxies whose `X-Forwarded-For` is kept.
    pub trusted_proxies: Vec<String>,
    /// `null` turns request ids off.
    pub request_id_header: Option<String>,
    /// `null` forwards every path.
    pub allowed_paths: Option<Vec<String>>,
}

impl Default for Forwarding {
    fn default() -> Self {
        let f = ForwardingSettings::default();
        Self {
            trusted_proxies: Vec::new(),
            request_id_header: f.request_id_header.map(|h| h.as_str().to_owned()),
            allowed_paths: f.allowed_paths,
        }
    }
}

/// One line per request on standard output.
#[derive(Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AccessLog {
    /// plain, json or off.
    pub format: AccessLogFormat,
    /// The secret the log's key hashes are keyed with (the same on every replica, for logs
    /// that group across them); a random one per process when absent.
    pub hash_secret: Option<String>,
}
