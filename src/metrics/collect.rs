//! The gauges read at scrape time from the live cluster and the API keys in force, so that they
//! cannot drift from the state the router and the proxy act on.

use std::sync::Arc;

use prometheus::core::{Atomic, Collector, Desc, GenericGaugeVec};
use prometheus::proto::MetricFamily;
use prometheus::{Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts};

use super::counters;
use crate::router::Router;
use crate::routing::PoolChoice;
use crate::tenants::Tenants;

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

const RECORD_UNSEEN: (&str, &str) = (
    "prefixlb_prefix_record_unseen_later_turns_ratio",
    "Share of later chat turns lately whose conversation the record had not seen open (auto shared-prefix placement is on below 0.05)",
);

const PEER_GAUGES: [(&str, &str); 10] = [
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
        "prefixlb_peer_wedged",
        "1 while the peer takes no new request: it carried requests and sent nothing for upstream.wedge_after_ms",
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

const PEER_RATE: (&str, &str) = (
    "prefixlb_peer_prefill_tokens_per_second",
    "Prompt tokens each peer prefills a second, as learned from its first bytes (the configured starting value until it has shown its own)",
);

/// The engine's cached tokens against the record's prediction, over the answers that
/// reported them (how well routing places prompts, in the engine's own count), and the times
/// the peer was found wedged.
const PEER_COUNTERS: [(&str, &str); 5] = [
    (
        "prefixlb_peer_usage_prompt_tokens_total",
        "Prompt tokens of the answers whose usage said how many were cached",
    ),
    (
        "prefixlb_peer_predicted_cached_tokens_total",
        "Cached prompt tokens the prompt record predicted, over the same answers",
    ),
    (
        "prefixlb_peer_reported_cached_tokens_total",
        "Cached prompt tokens the engine reported, over the same answers",
    ),
    (
        "prefixlb_peer_cache_misses_total",
        "Answers whose engine had more than a quarter of the prompt less cached than the prompt record predicted",
    ),
    (
        "prefixlb_peer_wedges_total",
        "Times the peer was found wedged (requests on it and no byte from it for upstream.wedge_after_ms)",
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
        let rate: GaugeVec = gauge_vecs(&[PEER_RATE], "peer").remove(0);
        let counters: Vec<IntCounterVec> = PEER_COUNTERS
            .iter()
            .map(|(name, help)| {
                IntCounterVec::new(Opts::new(*name, *help), &["peer"]).expect("valid metric")
            })
            .collect();
        for p in cluster.peers() {
            let values = [
                i64::from(p.in_flight()),
                i64::from(cluster.bound(&self.router.balance, p)),
                i64::from(p.healthy()),
                i64::from(p.draining()),
                i64::from(p.ejected()),
                i64::from(p.wedged()),
                i64::from(p.external()),
                p.engine().map_or(-1, |(e, _)| i64::from(e.waiting)),
                p.prefill_queue() as i64,
                self.router.estimated_wait(p).as_millis() as i64,
            ];
            for (vec, value) in vecs.iter().zip(values) {
                vec.with_label_values(&[p.id()]).set(value);
            }
            rate.with_label_values(&[p.id()]).set(
                p.prefill_rate()
                    .unwrap_or(self.router.balance.cost.prefill_tokens_per_sec),
            );
            let c = p.cache_report();
            let counts = [
                c.prompt_tokens,
                c.predicted_cached,
                c.reported_cached,
                c.misses,
                p.wedges(),
            ];
            for (vec, value) in counters.iter().zip(counts) {
                vec.with_label_values(&[p.id()]).inc_by(value);
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
        let unseen = Gauge::new(RECORD_UNSEEN.0, RECORD_UNSEEN.1).expect("valid metric");
        unseen.set(cluster.record().coverage.unseen());
        vecs.iter()
            .chain(&pool_vecs)
            .flat_map(|v| v.collect())
            .chain(rate.collect())
            .chain(counters.iter().flat_map(|v| v.collect()))
            .chain(depth.collect())
            .chain(record.flatten())
            .chain(evictions.collect())
            .chain(unsent.collect())
            .chain(unseen.collect())
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

/// Registers the per-peer (and per-tenant, with API keys) gauges, the counters and the build
/// info; call once, at start.
pub fn register(router: Arc<Router>, tenants: Option<Arc<Tenants>>) -> prometheus::Result<()> {
    if let Some(tenants) = tenants {
        let descs = descs(&TENANT_GAUGES, "key")?;
        prometheus::register(Box::new(TenantGauges { tenants, descs }))?;
        counters::register_tenant_counters();
    }
    let mut peer_descs = descs(&PEER_GAUGES, "peer")?;
    peer_descs.extend(descs(&[PEER_RATE], "peer")?);
    peer_descs.extend(descs(&PEER_COUNTERS, "peer")?);
    peer_descs.extend(descs(&POOL_GAUGES, "model")?);
    for (name, help) in RECORD_GAUGES.iter().chain([
        &QUEUE_DEPTH,
        &RECORD_EVICTIONS,
        &RECORD_UNSENT,
        &RECORD_UNSEEN,
    ]) {
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
    counters::register_counters();
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::routing::Route;

    #[test]
    fn a_removed_peer_forgets_the_series_of_every_route() {
        for route in Route::ALL {
            assert!(
                super::counters::ROUTES.contains(&route.as_str()),
                "{route:?}"
            );
        }
    }
}
