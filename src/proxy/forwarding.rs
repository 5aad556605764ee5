//! What the proxy adds to a request on its way to an engine, and which requests it forwards at
//! all: `X-Forwarded-For`/`-Proto`, a request id, and the allowlist of paths.

use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use http::{HeaderMap, HeaderName};
use pingora::http::RequestHeader;

use crate::settings::ForwardingSettings;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// The longest request id taken from a client; a longer one is replaced.
const MAX_REQUEST_ID: usize = 128;

pub struct Forwarding {
    settings: ForwardingSettings,
    /// Request ids made here: a per-process random key over a counter, so that ids neither
    /// repeat nor tell how many requests came before.
    ids: std::collections::hash_map::RandomState,
    issued: AtomicU64,
}

impl Forwarding {
    pub fn new(settings: ForwardingSettings) -> Self {
        Self {
            settings,
            ids: std::collections::hash_map::RandomState::new(),
            issued: AtomicU64::new(0),
        }
    }

    /// Whether requests for `path` go to an engine at all.
    pub fn allows(&self, path: &str) -> bool {
        self.settings
            .allowed_paths
            .as_ref()
            .is_none_or(|allowed| allowed.iter().any(|p| matches(p, path)))
    }

    /// Whether a request is one an engine answers from memory (a model list, a health probe,
    /// its version): it takes a slot on its peer, but no bound refuses it and it never waits
    /// in line behind prompts on a full cluster. Everything else is bounded, GETs included:
    /// SGLang's `/health_generate` runs a generation, a `GET /v1/responses/{id}` may stream.
    pub fn is_light(method: &http::Method, path: &str) -> bool {
        matches!(*method, http::Method::GET | http::Method::HEAD)
            && LIGHT_PATHS.iter().any(|p| matches(p, path))
    }

    /// The request's id: the client's when it sent a usable one, a new one otherwise; `None`
    /// when request ids are off.
    pub fn request_id(&self, headers: &HeaderMap) -> Option<String> {
        let name = self.settings.request_id_header.as_ref()?;
        let given = headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .filter(|id| usable_id(id));
        Some(match given {
            Some(id) => id.to_owned(),
            None => {
                let n = self.issued.fetch_add(1, Ordering::Relaxed);
                format!(
                    "{:016x}{:016x}",
                    self.ids.hash_one((n, 0u8)),
                    self.ids.hash_one((n, 1u8))
                )
            }
        })
    }

    /// Adds what the engine should know of the client to the request sent upstream (`tls`:
    /// the client reached this proxy over TLS). An incoming `X-Forwarded-For` is kept (and
    /// appended to) only from a trusted proxy: from anyone else it is whatever they chose to
    /// write.
    pub fn apply(
        &self,
        upstream: &mut RequestHeader,
        client: Option<IpAddr>,
        tls: bool,
        request_id: Option<&str>,
    ) -> pingora::Result<()> {
        let trusted = client.is_some_and(|ip| {
            self.settings
                .trusted_proxies
                .iter()
                .any(|net| net.contains(&ip))
        });
        // The chain so far, from a trusted proxy only; then the client itself.
        let mut chain = String::new();
        if trusted {
            for before in upstream.headers.get_all(&X_FORWARDED_FOR) {
                if let Ok(before) = before.to_str() {
                    chain.push_str(before);
                    chain.push_str(", ");
                }
            }
        }
        upstream.remove_header(&X_FORWARDED_FOR);
        if let Some(ip) = client {
            use std::fmt::Write;
            let _ = write!(chain, "{ip}");
            upstream.insert_header(X_FORWARDED_FOR, chain)?;
        }
        if !(trusted && upstream.headers.contains_key(&X_FORWARDED_PROTO)) {
            upstream.insert_header(X_FORWARDED_PROTO, if tls { "https" } else { "http" })?;
        }
        if let (Some(name), Some(id)) = (&self.settings.request_id_header, request_id) {
            upstream.insert_header(name.clone(), id)?;
        }
        Ok(())
    }

    pub fn request_id_header(&self) -> Option<&HeaderName> {
        self.settings.request_id_header.as_ref()
    }
}

/// What an engine answers from memory.
const LIGHT_PATHS: &[&str] = &[
    "/v1/models",
    "/v1/models/*",
    "/health",
    "/ping",
    "/version",
    "/get_model_info",
];

/// Whether `path` is `pattern`, or lies below a `pattern` ending in `/*`. Below a star, no `.`
/// or `..` segment, written plainly or percent-encoded, and no encoded slash: a proxy between
/// here and the engine that decoded and resolved them would reach a path the list does not
/// name.
fn matches(pattern: &str, path: &str) -> bool {
    match pattern.strip_suffix("/*") {
        Some(prefix) => path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/') && rest.split('/').all(plain_segment)),
        None => pattern == path,
    }
}

/// A path segment that names itself, decoded once as a proxy on the way may decode it.
fn plain_segment(segment: &str) -> bool {
    if !segment.contains('%') {
        return segment != "." && segment != "..";
    }
    let decoded = percent_encoding::percent_decode_str(segment).collect::<Vec<u8>>();
    decoded != b"." && decoded != b".." && !decoded.iter().any(|&b| b == b'/' || b == b'\\')
}

/// An id that is safe to pass on and to write into a log line as it is.
fn usable_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_REQUEST_ID
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/+=".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forwarding(trusted: &[&str], allowed: Option<&[&str]>) -> Forwarding {
        Forwarding::new(ForwardingSettings {
            trusted_proxies: trusted.iter().map(|n| n.parse().unwrap()).collect(),
            request_id_header: Some(HeaderName::from_static("x-request-id")),
            allowed_paths: allowed.map(|a| a.iter().map(|p| p.to_string()).collect()),
        })
    }

    fn upstream(xff: Option<&str>) -> RequestHeader {
        let mut h = RequestHeader::build("POST", b"/v1/chat/completions", None).unwrap();
        if let Some(v) = xff {
            h.insert_header("x-forwarded-for", v).unwrap();
            h.insert_header("x-forwarded-proto", "https").unwrap();
        }
        h
    }

    fn header<'a>(h: &'a RequestHeader, name: &str) -> Option<&'a str> {
        h.headers.get(name).and_then(|v| v.to_str().ok())
    }

    #[test]
    fn forwarded_for_is_appended_only_from_trusted_proxies() {
        let f = forwarding(&["10.0.0.0/8"], None);
        let (proxy, stranger) = ("10.1.2.3".parse().ok(), "192.0.2.7".parse().ok());
        let mut from_proxy = upstream(Some("198.51.100.1"));
        f.apply(&mut from_proxy, proxy, false, Some("r1")).unwrap();
        assert_eq!(
            header(&from_proxy, "x-forwarded-for"),
            Some("198.51.100.1, 10.1.2.3")
        );
        assert_eq!(header(&from_proxy, "x-forwarded-proto"), Some("https"));
        assert_eq!(header(&from_proxy, "x-request-id"), Some("r1"));
        let mut forged = upstream(Some("127.0.0.1"));
        f.apply(&mut forged, stranger, false, None).unwrap();
        assert_eq!(header(&forged, "x-forwarded-for"), Some("192.0.2.7"));
        assert_eq!(header(&forged, "x-forwarded-proto"), Some("http"));
        // Over TLS to this proxy, said so; a trusted proxy's own word stands.
        let mut over_tls = upstream(None);
        f.apply(&mut over_tls, stranger, true, None).unwrap();
        assert_eq!(header(&over_tls, "x-forwarded-proto"), Some("https"));
        let mut from_proxy = upstream(None);
        from_proxy
            .insert_header("x-forwarded-proto", "http")
            .unwrap();
        f.apply(&mut from_proxy, proxy, true, None).unwrap();
        assert_eq!(header(&from_proxy, "x-forwarded-proto"), Some("http"));
    }

    #[test]
    fn a_usable_request_id_is_kept_and_anything_else_replaced() {
        let f = forwarding(&[], None);
        let mut h = HeaderMap::new();
        h.insert("x-request-id", "abc-123".parse().unwrap());
        assert_eq!(f.request_id(&h).as_deref(), Some("abc-123"));
        h.insert("x-request-id", "a b\" injected=1".parse().unwrap());
        let made = f.request_id(&h).unwrap();
        assert_eq!(made.len(), 32);
        assert!(usable_id(&made));
        assert_ne!(Some(made), f.request_id(&HeaderMap::new()), "ids repeat");
    }

    #[test]
    fn paths_match_exactly_or_below_a_star() {
        let f = forwarding(&[], Some(&["/v1/chat/completions", "/v1/models/*"]));
        assert!(f.allows("/v1/chat/completions"));
        assert!(f.allows("/v1/models/llama"));
        assert!(!f.allows("/v1/models"));
        assert!(!f.allows("/v1/modelsx/y"));
        assert!(!f.allows("/v1/chat/completions/x"));
        assert!(!f.allows("/start_profile"));
        assert!(!f.allows("/v1/models/../../start_profile"));
        assert!(!f.allows("/v1/models/./x"));
        // Encoded, for a proxy on the way that decodes before it resolves.
        assert!(!f.allows("/v1/models/%2e%2e/start_profile"));
        assert!(!f.allows("/v1/models/%2E./start_profile"));
        assert!(!f.allows("/v1/models/.%2E/%2e%2E/start_profile"));
        assert!(!f.allows("/v1/models/%2e/x"));
        assert!(!f.allows("/v1/models/..%2fstart_profile"));
        assert!(!f.allows("/v1/models/..%5Cstart_profile"));
        assert!(f.allows("/v1/models/org%2Dmodel"));
        assert!(f.allows("/v1/models/a..b"));
        assert!(forwarding(&[], None).allows("/anything"));
        assert!(Forwarding::is_light(&http::Method::GET, "/v1/models/m"));
        assert!(!Forwarding::is_light(
            &http::Method::GET,
            "/health_generate"
        ));
        assert!(!Forwarding::is_light(&http::Method::POST, "/v1/models"));
    }
}
