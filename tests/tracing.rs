//! Traces, end to end: a real prefixlb exporting to an OTLP/HTTP collector the test runs, in
//! front of mock engines that record the headers they were sent.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// What the collector was sent: each span with its resource's `service.name`.
#[derive(Clone, Default)]
struct Received {
    spans: Arc<Mutex<Vec<(String, Span)>>>,
    posts: Arc<Mutex<Vec<String>>>,
}

/// An OTLP/HTTP collector: `POST /v1/traces`, protobuf.
async fn start_collector() -> (String, Received) {
    let received = Received::default();
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(collect))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}/v1/traces"), received)
}

async fn collect(
    State(received): State<Received>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, [(&'static str, &'static str); 1], Vec<u8>) {
    let kind = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    received.posts.lock().unwrap().push(kind.to_owned());
    let request = ExportTraceServiceRequest::decode(body).unwrap();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .and_then(|a| text(a.value.as_ref()?.value.as_ref()?))
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                received.spans.lock().unwrap().push((service.clone(), span));
            }
        }
    }
    let answer = ExportTraceServiceResponse::default().encode_to_vec();
    (
        StatusCode::OK,
        [("content-type", "application/x-protobuf")],
        answer,
    )
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// A span's attribute, as text whatever its type.
fn attribute(span: &Span, key: &str) -> Option<String> {
    let value = span
        .attributes
        .iter()
        .find(|a| a.key == key)?
        .value
        .as_ref()?;
    match value.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(n) => Some(n.to_string()),
        other => Some(format!("{other:?}")),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// prefixlb exporting to `endpoint`, with its batches sent every 100 ms (the SDK's standard
/// variable) rather than every 5 s.
async fn traced_proxy(up: &Upstream, endpoint: &str) -> Proxy {
    let config = TestConfig::new()
        .peers(&[up])
        .tracing(endpoint, "prefixlb-test");
    let mut proxy = spawn_proxy_adjusted(&config, &PingoraConfig::new(), |c| {
        c.env("OTEL_BSP_SCHEDULE_DELAY", "100");
    });
    proxy.wait_ready().await;
    // The exporter starts with the server's services, a moment after the listeners may.
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy
}

async fn chat_through(proxy: &Proxy, headers: &[(&str, &str)]) {
    let mut request = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-mock-cached-tokens", "64")
        .body(chat("you are a test", "hello", 1, false));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200);
    response.bytes().await.unwrap();
}

/// The spans of `trace_id` the collector got within a few seconds.
async fn spans_of(received: &Received, trace_id: &str) -> Vec<(String, Span)> {
    let start = Instant::now();
    loop {
        let found: Vec<_> = received
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| hex(&s.trace_id) == trace_id)
            .cloned()
            .collect();
        if !found.is_empty() || start.elapsed() > Duration::from_secs(10) {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn header(up: &Upstream, name: &str) -> Option<String> {
    let seen = up.seen();
    let last = seen.last().expect("the engine got the request");
    last.headers
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

/// `00-<trace>-<parent>-<flags>`, split.
fn parts(traceparent: &str) -> (String, String, String) {
    let p: Vec<_> = traceparent.split('-').collect();
    assert_eq!(p.len(), 4, "{traceparent}");
    assert_eq!(p[0], "00");
    (p[1].to_owned(), p[2].to_owned(), p[3].to_owned())
}

#[tokio::test]
async fn a_client_trace_goes_on_through_prefixlbs_span_to_the_engine_and_the_collector() {
    let [up] = upstreams::<1>().await;
    let (endpoint, received) = start_collector().await;
    let proxy = traced_proxy(&up, &endpoint).await;
    let traceparent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    chat_through(
        &proxy,
        &[
            ("traceparent", traceparent.as_str()),
            ("tracestate", "vendor=abc"),
        ],
    )
    .await;

    let (trace, parent, flags) = parts(&header(&up, "traceparent").unwrap());
    assert_eq!(trace, TRACE_ID, "the engine's trace is the client's");
    assert_ne!(
        parent, CLIENT_SPAN,
        "the engine's parent is prefixlb's span"
    );
    assert_eq!(flags, "01");
    assert_eq!(header(&up, "tracestate").as_deref(), Some("vendor=abc"));

    let spans = spans_of(&received, TRACE_ID).await;
    assert_eq!(spans.len(), 1, "one span per request");
    let (service, span) = &spans[0];
    assert_eq!(service, "prefixlb-test");
    assert_eq!(hex(&span.parent_span_id), CLIENT_SPAN);
    assert_eq!(
        hex(&span.span_id),
        parent,
        "the span the engine was told of"
    );
    assert_eq!(span.kind, SpanKind::Server as i32);
    assert_eq!(span.name, "POST /v1/chat/completions");
    assert_eq!(attribute(span, "prefixlb.peer"), Some(up.addr_str()));
    for (name, value) in [
        ("prefixlb.key_source", "chat"),
        ("prefixlb.route", "primary"),
        ("http.response.status_code", "200"),
        ("prefixlb.upstream_status", "200"),
        ("prefixlb.cached_tokens", "64"),
        ("prefixlb.prompt_tokens", "100"),
    ] {
        assert_eq!(attribute(span, name).as_deref(), Some(value), "{name}");
    }
    for present in [
        "prefixlb.ttft_ms",
        "prefixlb.queue_wait_ms",
        "prefixlb.request_id",
    ] {
        assert!(attribute(span, present).is_some(), "{present} missing");
    }
    assert!(span.end_time_unix_nano >= span.start_time_unix_nano);
    let posts = received.posts.lock().unwrap().clone();
    assert!(
        posts.iter().all(|k| k == "application/x-protobuf"),
        "{posts:?}"
    );
}

#[tokio::test]
async fn a_request_without_a_traceparent_begins_a_trace_of_its_own() {
    let [up] = upstreams::<1>().await;
    let (endpoint, received) = start_collector().await;
    let proxy = traced_proxy(&up, &endpoint).await;
    // An invalid one counts as none: its tracestate goes with it.
    chat_through(
        &proxy,
        &[
            ("traceparent", "00-zz-00f067aa0ba902b7-01"),
            ("tracestate", "vendor=abc"),
        ],
    )
    .await;

    let (trace, parent, flags) = parts(&header(&up, "traceparent").unwrap());
    assert_ne!(trace, "0".repeat(32));
    assert_eq!(flags, "01", "sampled at the default ratio of 1");
    assert_eq!(header(&up, "tracestate"), None);
    let spans = spans_of(&received, &trace).await;
    assert_eq!(spans.len(), 1);
    let span = &spans[0].1;
    assert!(span.parent_span_id.is_empty(), "a root span");
    assert_eq!(hex(&span.span_id), parent);
}

#[tokio::test]
async fn a_trace_the_client_did_not_sample_is_passed_on_and_not_sent() {
    let [up] = upstreams::<1>().await;
    let (endpoint, received) = start_collector().await;
    let proxy = traced_proxy(&up, &endpoint).await;
    let traceparent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-00");
    chat_through(&proxy, &[("traceparent", traceparent.as_str())]).await;

    let (trace, parent, flags) = parts(&header(&up, "traceparent").unwrap());
    assert_eq!((trace.as_str(), flags.as_str()), (TRACE_ID, "00"));
    assert_ne!(parent, CLIENT_SPAN);
    // A traced request after it shows the exporter ran meanwhile.
    chat_through(&proxy, &[]).await;
    let (after, _, _) = parts(&header(&up, "traceparent").unwrap());
    assert_eq!(spans_of(&received, &after).await.len(), 1);
    assert!(spans_of_now(&received, TRACE_ID).is_empty());
}

fn spans_of_now(received: &Received, trace_id: &str) -> Vec<Span> {
    let spans = received.spans.lock().unwrap();
    spans
        .iter()
        .filter(|(_, s)| hex(&s.trace_id) == trace_id)
        .map(|(_, s)| s.clone())
        .collect()
}

#[tokio::test]
async fn with_tracing_off_nothing_is_sent_and_the_trace_headers_pass_unchanged() {
    let [up] = upstreams::<1>().await;
    let (endpoint, received) = start_collector().await;
    // The SDK's own variables name the collector: they alone must not turn traces on.
    let config = TestConfig::new().peers(&[&up]);
    let mut proxy = spawn_proxy_adjusted(&config, &PingoraConfig::new(), |c| {
        c.env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &endpoint)
            .env("OTEL_BSP_SCHEDULE_DELAY", "100");
    });
    proxy.wait_ready().await;
    let traceparent = format!("00-{TRACE_ID}-{CLIENT_SPAN}-01");
    chat_through(
        &proxy,
        &[
            ("traceparent", traceparent.as_str()),
            ("tracestate", "vendor=abc"),
        ],
    )
    .await;
    assert_eq!(header(&up, "traceparent"), Some(traceparent));
    assert_eq!(header(&up, "tracestate").as_deref(), Some("vendor=abc"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(received.posts.lock().unwrap().is_empty());
}

#[tokio::test]
async fn the_queued_spans_are_sent_when_prefixlb_stops() {
    let [up] = upstreams::<1>().await;
    let (endpoint, received) = start_collector().await;
    // The SDK's default batch delay (5 s): the span is still queued when the stop comes.
    let config = TestConfig::new()
        .peers(&[&up])
        .tracing(&endpoint, "prefixlb-test");
    let mut proxy =
        spawn_proxy_adjusted(&config, &PingoraConfig::new().grace_seconds(1, 1), |_| {});
    proxy.wait_ready().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    chat_through(&proxy, &[]).await;
    let (trace, _, _) = parts(&header(&up, "traceparent").unwrap());
    assert!(
        spans_of_now(&received, &trace).is_empty(),
        "sent before the stop"
    );
    proxy.signal("TERM");
    proxy.exits(Duration::from_secs(10)).await;
    assert_eq!(spans_of_now(&received, &trace).len(), 1, "{}", proxy.log());
}
