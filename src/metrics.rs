//! Prometheus metrics, in the default registry that pingora-prometheus serves.
//!
//! Per-peer gauges (in flight, bound, health, drain, ejection) are read from the live cluster
//! at scrape time, so they cannot drift from the state the router acts on; counters and
//! histograms are updated on the request path.

use std::sync::{Arc, LazyLock};

use prometheus::core::{Atomic, Collector, Desc, GenericGaugeVec};
use prometheus::proto::MetricFamily;
use prometheus::{
    self, register_histogram, register_int_counter, register_int_counter_vec, register_int_gauge,
    register_int_gauge_vec, GaugeVec, Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts,
};

use crate::router::Router;
use crate::routing::PoolChoice;
use crate::tenants::Tenants;

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
    "Requests answered by each peer, by how the peer was chosen (primary, overflow, replica, retry, balanced) and status class (2xx..5xx, or error when no status came)",
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
metric!(REJECTIONS: IntCounterVec = register_int_counter_vec!(
    "prefixlb_rejections_total",
    "Requests answered without a peer: 503 for want of a slot (queue_full, queue_timeout, no_peer, retry_saturated), waiters that left (client_gone), peeks beyond the memory budget (peek_memory), paths not forwarded (path_not_allowed)",
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
    "Requests by the source of their routing key: session_header, chat, completions, generate, client_addr, none",
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
    "The replicas' exchange of where prompts went: datagrams sent (each to every other replica), prompts heard, datagrams refused (from an address not listed)",
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
    "Changes read from the API keys file and the listeners' certificates, by kind (api_keys, certificate) and result (changed, or error when the last good contents stay)",
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

/// Per-peer gauges, read from the router at each scrape.
struct PeerGauges {
    router: Arc<Router>,
    descs: Vec<Desc>,
}

const QUEUE_DEPTH: (&str, &str) = ("prefixlb_queue_depth", "Requests waiting for a slot now");

const RECORD_GAUGES: [(&str, &str); 3] = [
    (
        "prefixlb_prefix_record_bytes",
        "Memory of the record of where prompt blocks went (its budget, allocated at start)",
    ),
    (
        "prefixlb_prefix_record_capacity_entries",
        "Prompt blocks the record can hold",
    ),
    (
        "prefixlb_prefix_record_entries",
        "Prompt blocks the record holds",
    ),
];

const RECORD_EVICTIONS: (&str, &str) = (
    "prefixlb_prefix_record_evictions_total",
    "Prompt blocks the record forgot to make room for others",
);

const RECORD_UNSENT: (&str, &str) = (
    "prefixlb_prefix_record_unsent_total",
    "Prompts not told to the other replicas: the queue to them was full",
);

const PEER_GAUGES: [(&str, &str); 9] = [
    ("prefixlb_peer_in_flight", "Requests in flight on each peer"),
    (
        "prefixlb_peer_bound",
        "Each peer's in-flight ceiling now: min(max_in_flight, the balance bound)",
    ),
    (
        "prefixlb_peer_healthy",
        "1 while the peer passes its health checks",
    ),
    ("prefixlb_peer_draining", "1 while the peer is draining"),
    (
        "prefixlb_peer_ejected",
        "1 while the peer is ejected for failing",
    ),
    (
        "prefixlb_peer_external",
        "Requests on the peer that others carry, as the bound counts them: the other processes of an upgrade, or what the engine reports beyond this process's requests",
    ),
    (
        "prefixlb_peer_engine_waiting",
        "Requests waiting in the engine's own queue, as its metrics last said (-1: unknown)",
    ),
    (
        "prefixlb_peer_prefill_queue_tokens",
        "Prompt tokens sent to the peer that have no first byte yet (estimated)",
    ),
    (
        "prefixlb_peer_estimated_wait_ms",
        "The wait before its own prefill that least_cost expects for a request sent to the peer now",
    ),
];

const POOL_GAUGES: [(&str, &str); 2] = [
    (
        "prefixlb_pool_peers",
        "Eligible peers serving each model (with pools by model)",
    ),
    (
        "prefixlb_pool_in_flight",
        "Requests in flight on the peers serving each model (a peer serving several counts in each)",
    ),
];

impl Collector for PeerGauges {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let cluster = self.router.cluster();
        let vecs: Vec<IntGaugeVec> = gauge_vecs(&PEER_GAUGES, "peer");
        for p in cluster.peers() {
            let values = [
                i64::from(p.in_flight()),
                i64::from(cluster.bound(&self.router.balance, p)),
                i64::from(p.healthy()),
                i64::from(p.draining()),
                i64::from(p.ejected()),
                i64::from(p.external()),
                p.engine().map_or(-1, |(e, _)| i64::from(e.waiting)),
                p.prefill_queue() as i64,
                self.router.estimated_wait(p).as_millis() as i64,
            ];
            for (vec, value) in vecs.iter().zip(values) {
                vec.with_label_values(&[p.id()]).set(value);
            }
        }
        let pool_vecs: Vec<IntGaugeVec> = gauge_vecs(&POOL_GAUGES, "model");
        for model in cluster.pools().models() {
            let PoolChoice::Model(id) = cluster.pools().choose(Some(model), None) else {
                continue;
            };
            let serving = || cluster.peers().iter().filter(move |p| p.serves(id));
            let values = [
                serving().filter(|p| p.eligible()).count() as i64,
                serving().map(|p| i64::from(p.in_flight())).sum(),
            ];
            for (vec, value) in pool_vecs.iter().zip(values) {
                vec.with_label_values(&[model]).set(value);
            }
        }
        let depth = IntGauge::new(QUEUE_DEPTH.0, QUEUE_DEPTH.1).expect("valid metric");
        depth.set(self.router.load().waiters().len() as i64);
        let stats = cluster.record().stats();
        let record = RECORD_GAUGES
            .iter()
            .zip([stats.bytes, stats.capacity, stats.used])
            .map(|((name, help), value)| {
                let g = IntGauge::new(*name, *help).expect("valid metric");
                g.set(value as i64);
                g.collect()
            });
        let evictions =
            IntCounter::new(RECORD_EVICTIONS.0, RECORD_EVICTIONS.1).expect("valid metric");
        evictions.inc_by(stats.evictions);
        let unsent = IntCounter::new(RECORD_UNSENT.0, RECORD_UNSENT.1).expect("valid metric");
        unsent.inc_by(stats.unsent);
        vecs.iter()
            .chain(&pool_vecs)
            .flat_map(|v| v.collect())
            .chain(depth.collect())
            .chain(record.flatten())
            .chain(evictions.collect())
            .chain(unsent.collect())
            .collect()
    }
}

/// Per-tenant gauges, read from the API keys in force at each scrape: a key removed from the
/// file leaves the scrape with it.
struct TenantGauges {
    tenants: Arc<Tenants>,
    descs: Vec<Desc>,
}

const TENANT_GAUGES: [(&str, &str); 4] = [
    (
        "prefixlb_tenant_in_flight",
        "Requests of each API key in flight now",
    ),
    (
        "prefixlb_tenant_max_concurrent",
        "Each API key's cap on requests in flight (-1: none)",
    ),
    (
        "prefixlb_tenant_requests_per_second_limit",
        "Each API key's request rate limit (-1: none)",
    ),
    (
        "prefixlb_tenant_prompt_bytes_per_second_limit",
        "Each API key's prompt-byte rate limit (-1: none)",
    ),
];

impl Collector for TenantGauges {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let vecs: Vec<GaugeVec> = gauge_vecs(&TENANT_GAUGES, "key");
        for t in self.tenants.all() {
            let limits = t.limits();
            let values = [
                f64::from(t.in_flight()),
                limits.max_concurrent.map_or(-1.0, f64::from),
                limits.requests_per_second.unwrap_or(-1.0),
                limits.prompt_bytes_per_second.unwrap_or(-1.0),
            ];
            for (vec, value) in vecs.iter().zip(values) {
                vec.with_label_values(&[t.name()]).set(value);
            }
        }
        vecs.iter().flat_map(|v| v.collect()).collect()
    }
}

/// The gauges `defs` names, each with one `label`, fresh for one scrape.
fn gauge_vecs<P: Atomic>(defs: &[(&str, &str)], label: &str) -> Vec<GenericGaugeVec<P>> {
    defs.iter()
        .map(|(name, help)| {
            GenericGaugeVec::new(Opts::new(*name, *help), &[label]).expect("valid metric")
        })
        .collect()
}

fn descs(gauges: &[(&str, &str)], label: &str) -> prometheus::Result<Vec<Desc>> {
    gauges
        .iter()
        .map(|(name, help)| {
            Desc::new(
                name.to_string(),
                help.to_string(),
                vec![label.into()],
                Default::default(),
            )
        })
        .collect()
}

/// Registers the per-peer (and per-tenant, with API keys) gauges and the build info; call
/// once, at start.
pub fn register(router: Arc<Router>, tenants: Option<Arc<Tenants>>) -> prometheus::Result<()> {
    if let Some(tenants) = tenants {
        let descs = descs(&TENANT_GAUGES, "key")?;
        prometheus::register(Box::new(TenantGauges { tenants, descs }))?;
        LazyLock::force(&AUTH_FAILURES);
        LazyLock::force(&TENANT_REQUESTS);
    }
    let mut peer_descs = descs(&PEER_GAUGES, "peer")?;
    peer_descs.extend(descs(&POOL_GAUGES, "model")?);
    for (name, help) in
        RECORD_GAUGES
            .iter()
            .chain([&QUEUE_DEPTH, &RECORD_EVICTIONS, &RECORD_UNSENT])
    {
        peer_descs.push(Desc::new(
            name.to_string(),
            help.to_string(),
            vec![],
            Default::default(),
        )?);
    }
    prometheus::register(Box::new(PeerGauges {
        router,
        descs: peer_descs,
    }))?;
    BUILD_INFO
        .with_label_values(&[env!("CARGO_PKG_VERSION")])
        .set(1);
    // Register every metric now: the histograms and plain counters are then in the first
    // scrape; a labelled counter appears with its first sample.
    for counters in [
        &PEER_REQUESTS,
        &PEER_CONNECT_FAILURES,
        &PEER_EJECTIONS,
        &REJECTIONS,
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
    Ok(())
}

const ROUTES: [&str; 5] = ["primary", "overflow", "replica", "retry", "balanced"];
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
