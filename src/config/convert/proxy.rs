//! The proxy's settings: `proxy`, `queue`, `upstream`, `forwarding` and `access_log`. The CA
//! file `upstream.tls.ca_file` names is read afterwards, in `resolve`.

use std::time::Duration;

use http::HeaderName;

use super::values::{at_least_one, millis, path};
use crate::config::error::ConfigError;
use crate::config::schema::proxy::Forwarding;
use crate::config::schema::File;
use crate::routing::QueueLimit;
use crate::settings::{ForwardingSettings, PeekLimits, ProxySettings, Upstream, UpstreamTls};

pub fn proxy(f: &File) -> Result<ProxySettings, ConfigError> {
    let p = &f.proxy;
    at_least_one("proxy.peek.limit_bytes", p.peek.limit_bytes as u64)?;
    at_least_one("proxy.max_body_bytes", p.max_body_bytes as u64)?;
    if p.peek.memory_bytes < p.peek.limit_bytes.saturating_mul(2) {
        return Err(ConfigError::new(
            "proxy.peek.memory_bytes",
            format!(
                "must be at least twice proxy.peek.limit_bytes ({}): one peek holds its window and Pingora's copy of it",
                p.peek.limit_bytes.saturating_mul(2)
            ),
        ));
    }
    let u = &f.upstream;
    let q = &f.queue;
    if q.max_waiting > 0 && q.timeout_ms == 0 {
        return Err(ConfigError::new(
            "queue.timeout_ms",
            "must be at least 1 when max_waiting is above 0",
        ));
    }
    if p.default_model.as_deref() == Some("") {
        return Err(ConfigError::new(
            "proxy.default_model",
            "must not be empty (omit it for none)",
        ));
    }
    Ok(ProxySettings {
        default_model: p.default_model.clone(),
        peek: PeekLimits {
            peek_limit: p.peek.limit_bytes,
            max_body: p.max_body_bytes,
            deadline: millis("proxy.peek.timeout_ms", p.peek.timeout_ms)?,
            memory: p.peek.memory_bytes,
        },
        upstream: Upstream {
            connect_timeout: millis("upstream.connect_timeout_ms", u.connect_timeout_ms)?,
            read_timeout: millis("upstream.read_timeout_ms", u.read_timeout_ms)?,
            write_timeout: millis("upstream.write_timeout_ms", u.write_timeout_ms)?,
            idle_timeout: millis("upstream.idle_timeout_ms", u.idle_timeout_ms)?,
            connect_retries: u.connect_retries,
            wedge_after: Duration::from_millis(u.wedge_after_ms),
            stream_idle_timeout: Duration::from_millis(u.stream_idle_timeout_ms),
            tls: UpstreamTls {
                ca: None,
                verify: u.tls.verify,
            },
        },
        queue: QueueLimit {
            max_waiting: q.max_waiting,
            timeout: Duration::from_millis(q.timeout_ms),
        },
        access_log: f.access_log.format,
        access_log_key: match f.access_log.hash_secret.as_deref() {
            // Keyed with nothing, every deployment's labels would be the same, and a guessed
            // prompt confirmed by hashing it.
            Some("") => {
                return Err(ConfigError::new(
                    "access_log.hash_secret",
                    "must not be empty (omit it for a random one per process)",
                ))
            }
            secret => secret.map(str::to_owned),
        },
        client_write_timeout: millis("proxy.client_write_timeout_ms", p.client_write_timeout_ms)?,
        client_header_timeout: millis(
            "proxy.client_header_timeout_ms",
            p.client_header_timeout_ms,
        )?,
        forwarding: forwarding(&f.forwarding, &f.endpoints.paths())?,
    })
}

/// Header names HTTP itself reads: a request id must not replace one of them.
const FRAMING: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "expect",
    "proxy-connection",
];

fn forwarding(f: &Forwarding, key_paths: &[&String]) -> Result<ForwardingSettings, ConfigError> {
    let trusted_proxies = f
        .trusted_proxies
        .iter()
        .enumerate()
        .map(|(i, net)| {
            net.parse::<ipnet::IpNet>()
                .or_else(|_| net.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                .map_err(|_| {
                    ConfigError::new(
                        format!("forwarding.trusted_proxies[{i}]"),
                        format!("`{net}` is not an address or a network like 10.0.0.0/8"),
                    )
                })
        })
        .collect::<Result<_, _>>()?;
    let request_id_header = f
        .request_id_header
        .as_deref()
        .map(|h| {
            let field = "forwarding.request_id_header";
            let name = HeaderName::try_from(h)
                .map_err(|_| ConfigError::new(field, format!("`{h}` is not a header name")))?;
            if FRAMING.contains(&name.as_str()) {
                return Err(ConfigError::new(
                    field,
                    format!("`{h}` is a header HTTP itself reads: name another"),
                ));
            }
            Ok(name)
        })
        .transpose()?;
    let allowed_paths = match &f.allowed_paths {
        Some(paths) => {
            for (i, p) in paths.iter().enumerate() {
                path(&format!("forwarding.allowed_paths[{i}]"), p)?;
            }
            // The paths keys are read from are forwarded, whatever they were renamed to.
            let mut allowed = paths.clone();
            for &p in key_paths {
                if !p.is_empty() && !allowed.contains(p) {
                    allowed.push(p.clone());
                }
            }
            Some(allowed)
        }
        None => None,
    };
    Ok(ForwardingSettings {
        trusted_proxies,
        request_id_header,
        allowed_paths,
    })
}
