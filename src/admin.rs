//! The admin API, on its own listener (loopback by default): the peers and their load, and
//! draining a peer before its GPU is restarted; and a status page of them at `/`.

mod origin;
mod status;

use std::sync::Arc;

use async_trait::async_trait;
use http::{Method, Response, StatusCode};
use pingora::apps::http_app::ServeHttp;
use pingora::protocols::http::ServerSession;
use serde_json::json;
use subtle::ConstantTimeEq;

use crate::router::Router;

pub struct Admin {
    router: Arc<Router>,
    token: Option<String>,
}

impl Admin {
    pub fn new(router: Arc<Router>, token: Option<String>) -> Self {
        Self { router, token }
    }

    fn authorized(&self, session: &ServerSession) -> bool {
        let Some(token) = &self.token else {
            return true;
        };
        let given = session
            .req_header()
            .headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, given)| given.trim());
        // In constant time: how much of a guess matched must not show in how long it took.
        given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(token.as_bytes())))
    }

    /// `{"peers": [...], "in_flight": n, "waiting": n}`, the peers in address order.
    pub fn peers_json(&self) -> serde_json::Value {
        let cluster = self.router.cluster();
        let peers: Vec<_> = cluster
            .peers()
            .iter()
            .map(|p| {
                let cache = p.cache_report();
                json!({
                    "address": p.id(),
                    "weight": p.weight(),
                    // The name its certificate is checked for; null: plain HTTP.
                    "tls": p.tls().map(|name| name.as_str().to_owned()),
                    // The models it serves (listed, or as it said); null: any.
                    "models": p.models(),
                    "healthy": p.healthy(),
                    "draining": p.draining(),
                    "ejected": p.ejected(),
                    // Carried requests and sent nothing for the wedge limit: takes no new one
                    // until it sends again.
                    "wedged": p.wedged(),
                    "wedges": p.wedges(),
                    "in_flight": p.in_flight(),
                    "max_in_flight": (p.max_in_flight() != crate::routing::UNLIMITED).then(|| p.max_in_flight()),
                    "bound": cluster.bound(&self.router.balance, p),
                    // Requests others carry on the peer, as the bound counts them.
                    "external": p.external(),
                    // What the cost rule believes: the running slots the engine showed (null
                    // until it queued), the prefill sent and not yet answered, how long an
                    // answer streams, and the wait a request sent now would expect before its
                    // own prefill.
                    "capacity": (p.capacity() > 0).then(|| p.capacity()),
                    "prefill_queue_tokens": p.prefill_queue(),
                    "decode_ms": p.decode_time().map(|t| t.as_millis() as u64),
                    // Learned from the peer's first bytes; null until it has shown its own.
                    "prefill_tokens_per_second": p.prefill_rate().map(f64::round),
                    // The engine's own reports of cached tokens against the record's
                    // prediction, over the answers that carried them.
                    "cache": {
                        "prompt_tokens": cache.prompt_tokens,
                        "predicted_cached_tokens": cache.predicted_cached,
                        "reported_cached_tokens": cache.reported_cached,
                        "misses": cache.misses,
                    },
                    "estimated_wait_ms": self.router.estimated_wait(p).as_millis() as u64,
                    "engine": p.engine().map(|(e, age)| json!({
                        "running": e.running,
                        "waiting": e.waiting,
                        "kv_cache_usage": e.kv_cache_usage,
                        "age_ms": age.as_millis() as u64,
                    })),
                })
            })
            .collect();
        json!({
            "peers": peers,
            "in_flight": cluster.in_flight(),
            "waiting": self.router.load().waiters().len(),
        })
    }

    fn drain(&self, addr: &str, draining: bool) -> Option<serde_json::Value> {
        self.router
            .set_draining(addr, draining)
            .then(|| self.peers_json())
    }
}

fn reply(status: StatusCode, body: serde_json::Value) -> Response<Vec<u8>> {
    let body = body.to_string().into_bytes();
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(http::header::CONTENT_LENGTH, body.len())
        .body(body)
        .unwrap_or_default()
}

fn error(status: StatusCode, message: &str) -> Response<Vec<u8>> {
    reply(status, json!({ "error": { "message": message } }))
}

/// The method an endpoint takes; `None`: no such endpoint.
fn allowed(segments: &[&str]) -> Option<&'static str> {
    match segments {
        ["metrics"] | [""] | ["admin", "peers"] => Some("GET"),
        ["admin", "peers", _, "drain" | "undrain"] => Some("POST"),
        _ => None,
    }
}

#[async_trait]
impl ServeHttp for Admin {
    async fn response(&self, session: &mut ServerSession) -> Response<Vec<u8>> {
        // Scrapers rarely carry tokens: /metrics tells load, not secrets, and changes nothing.
        // The status page's HTML holds no figures: its own requests for them carry the token.
        let open = match session.req_header().uri.path() {
            "/metrics" => true,
            "/" => session.req_header().method == Method::GET,
            _ => false,
        };
        if !open && !self.authorized(session) {
            let mut refused = error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
            refused.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer"),
            );
            return refused;
        }
        if self.token.is_none() && origin::host_rebindable(&session.req_header().headers) {
            return error(
                StatusCode::FORBIDDEN,
                "a Host that is a name is refused without admin.token (a page of another site could have pointed that name at this listener): use the address, or localhost",
            );
        }
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_owned();
        let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
        if let Some(allow) = allowed(&segments).filter(|m| *m != method.as_str()) {
            let mut refused = error(
                StatusCode::METHOD_NOT_ALLOWED,
                &format!("{path} takes {allow} only"),
            );
            refused
                .headers_mut()
                .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
            return refused;
        }
        // Every POST that gets here carried the token, when one is set.
        let refused = origin::refusal(&session.req_header().headers, self.token.is_some());
        match (method, segments.as_slice()) {
            (Method::GET, ["metrics"]) => {
                pingora_prometheus::PrometheusHttpApp
                    .response(session)
                    .await
            }
            (Method::GET, [""]) => status::page(),
            (Method::GET, ["admin", "peers"]) => reply(StatusCode::OK, self.peers_json()),
            (Method::POST, ["admin", "peers", ..]) if refused.is_some() => error(
                StatusCode::FORBIDDEN,
                &format!(
                    "refused as a call a web page could have made: {}",
                    refused.unwrap_or_default()
                ),
            ),
            (Method::POST, ["admin", "peers", addr, action @ ("drain" | "undrain")]) => {
                match self.drain(addr, *action == "drain") {
                    Some(body) => reply(StatusCode::OK, body),
                    None => error(StatusCode::NOT_FOUND, "no such peer"),
                }
            }
            _ => error(StatusCode::NOT_FOUND, "no such admin endpoint"),
        }
    }
}
