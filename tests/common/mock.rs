//! The mock inference server: what it answers each request (steered by the request's headers,
//! as `start_upstream` tells) and what it records of them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use sha2::{Digest, Sha256};

use super::Upstream;

/// What a mock upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub len: usize,
    pub sha256: String,
    pub chunked: bool,
    pub content_length: Option<usize>,
    pub headers: HeaderMap,
}

#[derive(Clone)]
struct MockState {
    name: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    active: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
    healthy: Arc<AtomicBool>,
    health_checks: Arc<AtomicUsize>,
    engine_waiting: Arc<AtomicUsize>,
    models: Arc<Mutex<Vec<String>>>,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `got`, what came back on one connection, holds a 200 for each of `bodies` and the mock's
/// digest of each in the order they were sent.
pub fn assert_answered_in_order(got: &str, bodies: &[String]) {
    assert_eq!(got.matches("HTTP/1.1 200").count(), bodies.len(), "{got}");
    let at: Vec<usize> = bodies
        .iter()
        .map(|b| {
            got.find(&sha256_hex(b.as_bytes()))
                .expect("an answer per request")
        })
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "out of order: {got}");
}

pub(super) fn serve_mock<L>(name: &str, addr: SocketAddr, listener: L) -> Upstream
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let state = MockState {
        name: name.to_owned(),
        seen: Arc::default(),
        active: Arc::default(),
        peak: Arc::default(),
        healthy: Arc::new(AtomicBool::new(true)),
        health_checks: Arc::default(),
        engine_waiting: Arc::default(),
        models: Arc::default(),
    };
    let engine_waiting = Arc::clone(&state.engine_waiting);
    let models = Arc::clone(&state.models);
    let (seen, active, peak) = (
        Arc::clone(&state.seen),
        Arc::clone(&state.active),
        Arc::clone(&state.peak),
    );
    let (healthy, health_checks) = (Arc::clone(&state.healthy), Arc::clone(&state.health_checks));
    let app = axum::Router::new().fallback(mock).with_state(state);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Upstream {
        addr,
        name: name.to_owned(),
        seen,
        active,
        peak,
        healthy,
        health_checks,
        engine_waiting,
        models,
        task,
    }
}

fn header_num(h: &HeaderMap, name: &str) -> Option<u64> {
    h.get(name)?.to_str().ok()?.parse().ok()
}

struct Active(Arc<AtomicUsize>);
impl Drop for Active {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn mock(State(s): State<MockState>, req: Request) -> Response {
    // Its metrics, as an engine reports them: not a request it answers, so not counted.
    if req.uri().path() == "/metrics" {
        let page = format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\"}} {}\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"m\"}} {}\n",
            s.active.load(Ordering::SeqCst),
            s.engine_waiting.load(Ordering::SeqCst)
        );
        return reply(&s.name, StatusCode::OK, page);
    }
    let models = s.models.lock().unwrap().clone();
    if req.uri().path() == "/v1/models" && !models.is_empty() {
        let data: Vec<_> = models
            .iter()
            .map(|id| serde_json::json!({"id": id, "object": "model"}))
            .collect();
        let list = serde_json::json!({"object": "list", "data": data});
        return reply(&s.name, StatusCode::OK, list.to_string());
    }
    let now = s.active.fetch_add(1, Ordering::SeqCst) + 1;
    s.peak.fetch_max(now, Ordering::SeqCst);
    let active = Active(Arc::clone(&s.active));
    let (parts, body) = req.into_parts();
    let h = parts.headers;
    let chunked = h
        .get("transfer-encoding")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"));
    let content_length = header_num(&h, "content-length").map(|n| n as usize);
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(_) => return reply(&s.name, StatusCode::BAD_REQUEST, "{}".into()),
    };
    if parts.uri.path() == "/health" {
        s.health_checks.fetch_add(1, Ordering::SeqCst);
        let status = if s.healthy.load(Ordering::SeqCst) {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        return reply(&s.name, status, "{}".into());
    }
    s.seen.lock().unwrap().push(Seen {
        path: parts.uri.path().to_owned(),
        len: bytes.len(),
        sha256: sha256_hex(&bytes),
        chunked,
        content_length,
        headers: h.clone(),
    });
    if let Some(ms) = header_num(&h, "x-mock-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(status) = header_num(&h, "x-mock-status") {
        let status = StatusCode::from_u16(status as u16).unwrap();
        return reply(&s.name, status, r#"{"error":{"message":"mock"}}"#.into());
    }
    if parts.uri.path() == "/v1/responses" {
        return responses_api(&s, &bytes);
    }
    if let Some(events) = header_num(&h, "x-mock-events") {
        let interval = Duration::from_millis(header_num(&h, "x-mock-interval-ms").unwrap_or(10));
        let reset_after = header_num(&h, "x-mock-reset-after");
        let pad = "x".repeat(header_num(&h, "x-mock-event-bytes").unwrap_or(0) as usize);
        let stream = futures_util::stream::unfold(0u64, move |i| {
            let pad = pad.clone();
            async move {
                if i > events {
                    return None;
                }
                if i > 0 {
                    tokio::time::sleep(interval).await;
                }
                if reset_after == Some(i) {
                    // An error mid-body makes the server drop the connection: an upstream reset.
                    return Some((Err(std::io::Error::other("mock reset")), events + 1));
                }
                let line = if i == events {
                    "data: [DONE]\n\n".to_owned()
                } else {
                    format!("data: {{\"i\":{i},\"pad\":\"{pad}\"}}\n\n")
                };
                Some((Ok::<_, std::io::Error>(line), i + 1))
            }
        });
        // The guard lives as long as the stream: the request is active until it ends.
        let stream = futures_util::StreamExt::map(stream, move |item| {
            let _keep = &active;
            item
        });
        return Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .header("x-upstream", &s.name)
            .body(Body::from_stream(stream))
            .unwrap();
    }
    let mut body =
        serde_json::json!({"upstream": s.name, "len": bytes.len(), "sha256": sha256_hex(&bytes)});
    // The usage an engine reports, with as many prompt tokens found cached as the header says.
    if let Some(cached) = header_num(&h, "x-mock-cached-tokens") {
        body["usage"] = serde_json::json!({"prompt_tokens": 100, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}});
    }
    reply(&s.name, StatusCode::OK, body.to_string())
}

/// The Responses API as vLLM serves it: each response has an id this mock alone knows (its
/// name and a count), and a request continuing a response it does not hold gets a 404.
fn responses_api(s: &MockState, body: &[u8]) -> Response {
    let req: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let mine = format!("resp_{}_", s.name);
    if let Some(previous) = req["previous_response_id"].as_str() {
        if !previous.starts_with(&mine) {
            let error = serde_json::json!({"error": {"message": format!("Response with id '{previous}' not found."), "type": "invalid_request_error", "code": 404}});
            return reply(&s.name, StatusCode::NOT_FOUND, error.to_string());
        }
    }
    let id = format!("{mine}{}", s.seen.lock().unwrap().len());
    let response = serde_json::json!({"id": id, "object": "response", "status": "completed", "upstream": s.name});
    if req["stream"] != serde_json::json!(true) {
        return reply(&s.name, StatusCode::OK, response.to_string());
    }
    let mut events = String::new();
    for kind in ["response.created", "response.completed"] {
        let event = serde_json::json!({"type": kind, "response": response});
        events.push_str(&format!("event: {kind}\ndata: {event}\n\n"));
    }
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .header("x-upstream", &s.name)
        .body(Body::from(events))
        .unwrap()
}

fn reply(name: &str, status: StatusCode, body: String) -> Response {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-upstream", name)
        .body(Body::from(body))
        .unwrap()
}
