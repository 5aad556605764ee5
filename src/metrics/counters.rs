//! The counters and histograms the request path and the control plane update, and the build
//! info: statics that import nothing of the crate, so that any module may count.

use std::sync::LazyLock;

use prometheus::{
    register_histogram, register_int_counter, register_int_counter_vec, register_int_gauge,
    register_int_gauge_vec, Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
};

/// From 5 ms to 10 minutes: the range of a time to first token and of a long generation.
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

macro_rules! metric {
    ($name:ident: $ty:ty = $make:expr) => {
        pub static $name: LazyLock<$ty> =
            LazyLock::new(|| $make.expect(concat!("registering ", stringify!($name))));
    };
}

metric!(PEER_REQUESTS: IntCounterVec = register_int_counter_vec!(
    "prefixlb_peer_requests_total",
    "Requests answered by each peer, by how the peer was chosen (primary, overflow, replica, retry, balanced, affinity) and status class (2xx..5xx, or error when no status came)",
    &["peer", "route", "status_class"]
));
metric!(PEER_CONNECT_FAILURES: IntCounterVec = register_int_counter_vec!(
    "prefixlb_peer_connect_failures_total",
    "Connects to each peer that failed",
    &["peer"]
));
metric!(PEER_EJECTIONS: IntCounterVec = register_int_counter_vec!(
    "prefixlb_peer_ejections_total",
    "Times each peer was ejected for failing",
    &["peer"]
));
metric!(STREAM_ERRORS: IntCounterVec = register_int_counter_vec!(
    "prefixlb_stream_errors_total",
    "Streamed answers that ended early with an error event: the engine sent nothing for upstream.stream_idle_timeout_ms (stalled), or broke the stream off (broken)",
    &["reason"]
));
metric!(REJECTIONS: IntCounterVec = register_int_counter_vec!(
    "prefixlb_rejections_total",
    "Requests answered without a peer: 503 for want of a slot (queue_full, queue_timeout, no_peer), waiters that left (client_gone), heads that trickled in past their timeout (header_timeout), peeks beyond the memory budget (peek_memory), paths not forwarded (path_not_allowed)",
    &["reason"]
));
metric!(QUEUE_WAIT: Histogram = register_histogram!(
    "prefixlb_queue_wait_seconds",
    "Time requests waited in line for a slot (those that waited at all)",
    LATENCY_BUCKETS.to_vec()
));
metric!(FIRST_BYTE: Histogram = register_histogram!(
    "prefixlb_upstream_first_byte_seconds",
    "From choosing a peer to the first byte of its response body: the time to first token of a streamed completion, as the load balancer sees it",
    LATENCY_BUCKETS.to_vec()
));
metric!(DURATION: Histogram = register_histogram!(
    "prefixlb_request_duration_seconds",
    "From the request's arrival to the end of its response",
    LATENCY_BUCKETS.to_vec()
));
metric!(KEY_SOURCES: IntCounterVec = register_int_counter_vec!(
    "prefixlb_key_source_total",
    "Requests by the source of their routing key: session_header, chat, completions, generate, messages, responses, client_addr, none",
    &["source"]
));
metric!(PEEKED_BYTES: IntCounter = register_int_counter!(
    "prefixlb_body_peeked_bytes_total",
    "Request body bytes read before choosing a peer, to find the routing key"
));
metric!(PEEK_MEMORY: IntGauge = register_int_gauge!(
    "prefixlb_peek_memory_bytes",
    "Request body bytes held now for reading routing keys (prefixlb's and Pingora's retry copy), against limits.peek_memory_bytes"
));
metric!(ACCESS_LOG_DROPPED: IntCounter = register_int_counter!(
    "prefixlb_access_log_dropped_total",
    "Access log lines dropped because the writer's queue was full (stdout blocked)"
));
metric!(ENGINE_SCRAPE_FAILURES: IntCounter = register_int_counter!(
    "prefixlb_engine_scrape_failures_total",
    "Engine metrics pages that could not be read or held no request counts (the peer then counts this process's requests only)"
));
metric!(REPLICA_MESSAGES: IntCounterVec = register_int_counter_vec!(
    "prefixlb_replica_messages_total",
    "The replicas' exchange of where prompts went: datagrams sent (each to every other replica), prompts heard; datagrams refused (from an address not listed), forged (a signature that does not match), replayed (heard before, or older than the window), stale (sent more than 30 s from this clock) or unsigned (not signed with a key this process holds, or in an older version's format)",
    &["event"]
));
metric!(RELOADS: IntCounterVec = register_int_counter_vec!(
    "prefixlb_reloads_total",
    "Reloads of the peer list, by result: changed, unchanged or error",
    &["result"]
));
metric!(REGISTRY_FAILURES: IntCounter = register_int_counter!(
    "prefixlb_registry_failures_total",
    "Rounds of the Redis peer registry that failed (unreachable, timed out, refused): the last good peers stay"
));
metric!(FILE_RELOADS: IntCounterVec = register_int_counter_vec!(
    "prefixlb_file_reloads_total",
    "Changes read from the API keys file, the listeners' certificates and the replicas' key file, by kind (api_keys, certificate, replica_keys) and result (changed, or error when the last good contents stay)",
    &["kind", "result"]
));
metric!(AUTH_FAILURES: IntCounterVec = register_int_counter_vec!(
    "prefixlb_auth_failures_total",
    "Requests refused with 401 for want of a valid API key, by reason (missing, invalid)",
    &["reason"]
));
metric!(TENANT_REQUESTS: IntCounterVec = register_int_counter_vec!(
    "prefixlb_tenant_requests_total",
    "Requests of each API key, by outcome: admitted, or the limit that refused it with 429 (concurrency, request_rate, prompt_byte_rate)",
    &["key", "outcome"]
));
metric!(BUILD_INFO: IntGaugeVec = register_int_gauge_vec!(
    "prefixlb_build_info",
    "Always 1; the version label says which build is running",
    &["version"]
));

/// Sets the build info and registers every counter and histogram now: the histograms and plain
/// counters are then in the first scrape; a labelled counter appears with its first sample.
pub(crate) fn register_counters() {
    BUILD_INFO
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    for counters in [
        &PEER_REQUESTS,
        &PEER_CONNECT_FAILURES,
        &PEER_EJECTIONS,
        &REJECTIONS,
        &STREAM_ERRORS,
        &KEY_SOURCES,
        &RELOADS,
        &FILE_RELOADS,
        &REPLICA_MESSAGES,
    ] {
        LazyLock::force(counters);
    }
    for histogram in [&QUEUE_WAIT, &FIRST_BYTE, &DURATION] {
        LazyLock::force(histogram);
    }
    LazyLock::force(&PEEKED_BYTES);
    LazyLock::force(&PEEK_MEMORY);
    LazyLock::force(&ACCESS_LOG_DROPPED);
    LazyLock::force(&ENGINE_SCRAPE_FAILURES);
    LazyLock::force(&REGISTRY_FAILURES);
}

/// Registers the counters of API keys: only a proxy with keys has them.
pub(crate) fn register_tenant_counters() {
    LazyLock::force(&AUTH_FAILURES);
    LazyLock::force(&TENANT_REQUESTS);
}

/// Every label a route takes: the routes a choice gives (`Route::as_str`), and a retry's.
pub(crate) const ROUTES: [&str; 6] = [
    "primary", "overflow", "replica", "balanced", "affinity", "retry",
];
const STATUS_CLASSES: [&str; 6] = ["2xx", "3xx", "4xx", "5xx", "other", "error"];

/// Drops the series of a peer that left the cluster, so that pods coming and going under DNS
/// discovery do not pile up label values.
pub fn forget_peer(peer: &str) {
    for route in ROUTES {
        for class in STATUS_CLASSES {
            let _ = PEER_REQUESTS.remove_label_values(&[peer, route, class]);
        }
    }
    let _ = PEER_CONNECT_FAILURES.remove_label_values(&[peer]);
    let _ = PEER_EJECTIONS.remove_label_values(&[peer]);
}

/// Counts on a peer's series with `count`, unless the peer has left the cluster (`removed`):
/// its series were dropped then, and one counted after would stay for good. A removal racing
/// the count has dropped the series before it (then `removed` is seen: a series' update and
/// its removal take the same lock) or drops them after; either way they go.
pub fn count_peer(id: &str, removed: impl Fn() -> bool, count: impl FnOnce()) {
    if removed() {
        return;
    }
    count();
    if removed() {
        forget_peer(id);
    }
}

/// Counts one on `vec`'s series of the peer `id` (its one label), as [`count_peer`] does.
pub fn count_on_peer(vec: &IntCounterVec, id: &str, removed: impl Fn() -> bool) {
    count_peer(id, removed, || vec.with_label_values(&[id]).inc());
}

pub fn status_class(status: Option<u16>) -> &'static str {
    match status {
        Some(200..=299) => "2xx",
        Some(300..=399) => "3xx",
        Some(400..=499) => "4xx",
        Some(500..=599) => "5xx",
        Some(_) => "other",
        None => "error",
    }
}
