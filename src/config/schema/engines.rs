//! What is asked of the engines themselves: `health_check`, `engine_metrics`, `models`.

use serde::Deserialize;

use super::defaults::ms;
use crate::settings;

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthCheck {
    pub enabled: bool,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub healthy_after: usize,
    pub unhealthy_after: usize,
}

impl Default for HealthCheck {
    fn default() -> Self {
        let h = settings::HealthCheck::default();
        Self {
            enabled: true,
            path: h.path,
            interval_ms: ms(h.interval),
            timeout_ms: ms(h.timeout),
            healthy_after: h.healthy_after,
            unhealthy_after: h.unhealthy_after,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineMetricsFile {
    pub enabled: bool,
    pub path: String,
    pub interval_ms: u64,
    pub timeout_ms: u64,
}

impl Default for EngineMetricsFile {
    fn default() -> Self {
        let e = settings::EngineMetrics::default();
        Self {
            enabled: true,
            path: e.path,
            interval_ms: ms(e.interval),
            timeout_ms: ms(e.timeout),
        }
    }
}

/// Asking peers which models they serve.
#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelsFile {
    /// Whether a peer that lists no models is asked for its `/v1/models`. Off by default: an
    /// engine's list names its model, and requests naming another (as clients written for any
    /// OpenAI endpoint do) would then find no pool.
    pub discover: bool,
    pub interval_ms: u64,
}

impl Default for ModelsFile {
    fn default() -> Self {
        Self {
            discover: false,
            interval_ms: ms(settings::ModelDiscovery::DEFAULT_INTERVAL),
        }
    }
}
