//! The OpenAI-compatible HTTP face of one simulated GPU, with vLLM's metric names.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use prometheus::{Encoder, Gauge, IntCounter, IntGauge, Registry, TextEncoder};
use serde_json::{json, Value};

use super::{Gpu, Prefilled};

struct Served {
    gpu: Arc<Gpu>,
    name: String,
    model: String,
    metrics: Metrics,
}

struct Metrics {
    /// One scrape at a time: counters catch up with the engine's totals by difference.
    scrape: std::sync::Mutex<()>,
    registry: Registry,
    running: IntGauge,
    waiting: IntGauge,
    cache_usage: Gauge,
    queries: IntCounter,
    hits: IntCounter,
    requests: IntCounter,
    preemptions: IntCounter,
    evictions: IntCounter,
}

impl Metrics {
    fn new() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let m = Self {
            running: IntGauge::new("vllm:num_requests_running", "Requests running on the GPU")?,
            waiting: IntGauge::new("vllm:num_requests_waiting", "Requests waiting to run")?,
            cache_usage: Gauge::new(
                "vllm:kv_cache_usage_perc",
                "Fraction of the KV cache in use (0 to 1)",
            )?,
            queries: IntCounter::new(
                "vllm:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache",
            )?,
            hits: IntCounter::new(
                "vllm:prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache",
            )?,
            requests: IntCounter::new(
                "vllm:request_success_total",
                "Requests served to their last token",
            )?,
            preemptions: IntCounter::new(
                "vllm:num_preemptions_total",
                "Running requests preempted for KV memory",
            )?,
            evictions: IntCounter::new(
                "gpu_sim:prefix_cache_evictions_total",
                "Cached prefix blocks evicted to make room",
            )?,
            registry,
            scrape: std::sync::Mutex::new(()),
        };
        m.registry.register(Box::new(m.running.clone()))?;
        m.registry.register(Box::new(m.waiting.clone()))?;
        m.registry.register(Box::new(m.cache_usage.clone()))?;
        m.registry.register(Box::new(m.queries.clone()))?;
        m.registry.register(Box::new(m.hits.clone()))?;
        m.registry.register(Box::new(m.requests.clone()))?;
        m.registry.register(Box::new(m.preemptions.clone()))?;
        m.registry.register(Box::new(m.evictions.clone()))?;
        Ok(m)
    }
}

/// The HTTP routes of one GPU named `name` (its address, say), serving `model`.
pub fn router(gpu: Arc<Gpu>, name: String, model: String) -> prometheus::Result<Router> {
    let served = Arc::new(Served {
        gpu,
        name,
        model,
        metrics: Metrics::new()?,
    });
    Ok(Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .route("/v1/loads", get(loads))
        .route("/get_load", get(get_load))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .with_state(served))
}

fn error(status: StatusCode, message: &str) -> Response {
    let body =
        json!({"error": {"message": message, "type": "invalid_request_error", "code": null}});
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The text a chat template would give the model: each message's role and text, in order.
fn chat_prompt(body: &Value) -> Option<String> {
    let mut prompt = String::new();
    for m in body.get("messages")?.as_array()? {
        prompt.push_str(m.get("role").and_then(Value::as_str).unwrap_or("user"));
        prompt.push_str(": ");
        match m.get("content") {
            Some(Value::String(s)) => prompt.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        prompt.push_str(t);
                    }
                }
            }
            _ => {}
        }
        prompt.push('\n');
    }
    Some(prompt)
}

fn max_tokens(body: &Value, default: usize) -> usize {
    body.get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .map_or(default, |n| n as usize)
}

async fn chat(State(s): State<Arc<Served>>, body: Bytes) -> Response {
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "the body is not JSON");
    };
    let Some(prompt) = chat_prompt(&body) else {
        return error(StatusCode::BAD_REQUEST, "messages must be an array");
    };
    generate(s, prompt, &body, true).await
}

async fn completions(State(s): State<Arc<Served>>, body: Bytes) -> Response {
    let Ok(body) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "the body is not JSON");
    };
    let prompt = match body.get("prompt") {
        Some(Value::String(p)) => p.clone(),
        Some(Value::Array(a)) => a
            .first()
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => return error(StatusCode::BAD_REQUEST, "prompt must be a string"),
    };
    generate(s, prompt, &body, false).await
}

fn usage(done: Prefilled, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": done.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    })
}

fn token_text(i: usize) -> String {
    format!("tok{i} ")
}

fn chunk(model: &str, chat: bool, text: &str, finish: Option<&str>) -> String {
    let choice = if chat {
        json!({"index": 0, "delta": {"content": text}, "finish_reason": finish})
    } else {
        json!({"index": 0, "text": text, "finish_reason": finish})
    };
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    format!(
        "data: {}\n\n",
        json!({"id": "sim", "object": object, "model": model, "choices": [choice]})
    )
}

async fn generate(s: Arc<Served>, prompt: String, body: &Value, chat: bool) -> Response {
    let n = max_tokens(body, s.gpu.config.default_max_tokens);
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    if stream {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let served = Arc::clone(&s);
        // As vLLM does: the usage comes as one last event, only when asked for.
        let include_usage = body
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        tokio::spawn(async move {
            let model = served.model.clone();
            let mut done = None;
            served
                .gpu
                .run(
                    &prompt,
                    n,
                    |p| done = Some(p),
                    |i| tx.send(chunk(&model, chat, &token_text(i), None)).is_ok(),
                )
                .await;
            let _ = tx.send(chunk(&model, chat, "", Some("length")));
            if let Some(done) = done.filter(|_| include_usage) {
                let event =
                    json!({"id": "sim", "model": model, "choices": [], "usage": usage(done, n)});
                let _ = tx.send(format!("data: {event}\n\n"));
            }
            let _ = tx.send("data: [DONE]\n\n".to_owned());
        });
        let body = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|line| (Ok::<_, Infallible>(line), rx))
        });
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .header("x-upstream", &s.name)
            .body(Body::from_stream(body))
            .unwrap_or_default();
    }
    let mut text = String::new();
    let mut done = Prefilled {
        prompt_tokens: 0,
        cached_tokens: 0,
    };
    s.gpu
        .run(
            &prompt,
            n,
            |p| done = p,
            |i| {
                text.push_str(&token_text(i));
                true
            },
        )
        .await;
    let message = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
    } else {
        json!({"index": 0, "text": text, "finish_reason": "length"})
    };
    let body = json!({
        "id": "sim",
        "object": if chat { "chat.completion" } else { "text_completion" },
        "model": s.model,
        "choices": [message],
        "usage": usage(done, n),
    });
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (
                header::HeaderName::from_static("x-upstream"),
                s.name.as_str(),
            ),
        ],
        body.to_string(),
    )
        .into_response()
}

async fn models(State(s): State<Arc<Served>>) -> Response {
    let body = json!({"object": "list", "data": [{"id": s.model, "object": "model", "owned_by": "gpu-sim"}]});
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn metrics(State(s): State<Arc<Served>>) -> Response {
    let (g, m) = (&s.gpu, &s.metrics);
    let _one = m.scrape.lock().unwrap_or_else(|p| p.into_inner());
    m.running.set(g.stats.running.load(Ordering::Relaxed));
    m.waiting.set(g.stats.waiting.load(Ordering::Relaxed));
    m.cache_usage.set(g.cache_usage());
    // Counters only go up: bring each to the engine's running total.
    for (counter, total) in [
        (&m.queries, g.stats.prefix_queries.load(Ordering::Relaxed)),
        (&m.hits, g.stats.prefix_hits.load(Ordering::Relaxed)),
        (&m.requests, g.stats.requests.load(Ordering::Relaxed)),
        (&m.preemptions, g.stats.preemptions.load(Ordering::Relaxed)),
        (&m.evictions, g.stats.evictions.load(Ordering::Relaxed)),
    ] {
        counter.inc_by(total.saturating_sub(counter.get()));
    }
    let mut out = Vec::new();
    let encoder = TextEncoder::new();
    if encoder.encode(&m.registry.gather(), &mut out).is_err() {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "metrics encoding failed");
    }
    (
        [(header::CONTENT_TYPE, encoder.format_type().to_owned())],
        out,
    )
        .into_response()
}

/// SGLang's `/v1/loads`: one data-parallel rank's scheduler state, which SMG polls for its
/// load-aware policies (`token_usage` is the signal they act on).
async fn loads(State(s): State<Arc<Served>>) -> Response {
    let g = &s.gpu;
    let running = g.stats.running.load(Ordering::Relaxed).max(0);
    let waiting = g.stats.waiting.load(Ordering::Relaxed).max(0);
    let (used, total) = g.kv_tokens();
    let queries = g.stats.prefix_queries.load(Ordering::Relaxed);
    let hits = g.stats.prefix_hits.load(Ordering::Relaxed);
    let usage = g.cache_usage();
    let rank = json!({
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "token_usage": usage,
        "cache_hit_rate": if queries == 0 { 0.0 } else { hits as f64 / queries as f64 },
        "utilization": usage,
        "max_running_requests": g.config.max_running,
    });
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let body = json!({
        "timestamp": since_epoch.as_secs_f64().to_string(),
        "dp_rank_count": 1,
        "loads": [rank],
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// SGLang's older `/get_load`, which SMG before 1.3 polled: one entry per rank, read for
/// `num_tokens`.
async fn get_load(State(s): State<Arc<Served>>) -> Response {
    let g = &s.gpu;
    let running = g.stats.running.load(Ordering::Relaxed).max(0);
    let waiting = g.stats.waiting.load(Ordering::Relaxed).max(0);
    let body = json!([{
        "dp_rank": 0,
        "num_reqs": running + waiting,
        "num_waiting_reqs": waiting,
        "num_tokens": g.kv_tokens().0,
    }]);
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// SGLang's `/server_info`, in part: SMG probes it to tell an SGLang engine (whose load it
/// then polls on `/v1/loads`) from a vLLM one, retrying for seconds when nothing answers.
async fn server_info(State(s): State<Arc<Served>>) -> Response {
    let body = json!({
        "model_path": s.model,
        "served_model_name": s.model,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "max_total_tokens": s.gpu.kv_tokens().1,
        "max_running_requests": s.gpu.config.max_running,
        "version": concat!("gpu-sim ", env!("CARGO_PKG_VERSION")),
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// SGLang's `/model_info`, in part.
async fn model_info(State(s): State<Arc<Served>>) -> Response {
    let body = json!({"model_path": s.model, "tokenizer_path": s.model, "is_generation": true});
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}
