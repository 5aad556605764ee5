//! `tracing`: a span for each request, sent to an OpenTelemetry collector. Off when absent.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::defaults::ms;
use crate::settings::TraceSettings;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingFile {
    /// The collector's OTLP/HTTP traces URL, path included.
    pub otlp_endpoint: String,
    #[serde(default = "service_name")]
    pub service_name: String,
    #[serde(default = "sample_ratio")]
    pub sample_ratio: f64,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default = "timeout_ms")]
    pub timeout_ms: u64,
}

fn service_name() -> String {
    TraceSettings::DEFAULT_SERVICE_NAME.to_owned()
}

/// Every trace begun here is kept unless told otherwise: a collector can sample further, and a
/// proxy's span is cheap beside an inference.
fn sample_ratio() -> f64 {
    1.0
}

fn timeout_ms() -> u64 {
    ms(TraceSettings::DEFAULT_TIMEOUT)
}
