//! Traces: a span for each request, sent to an OpenTelemetry collector over OTLP/HTTP.

use std::time::Duration;

/// Where spans go and which are kept. `None` in [`super::Settings`]: no spans at all.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// The collector's OTLP/HTTP traces URL, whole: `http://collector:4318/v1/traces`.
    pub endpoint: http::Uri,
    /// `service.name` of every span.
    pub service_name: String,
    /// The share of traces begun here that are recorded. A trace the client began keeps the
    /// client's decision (its `traceparent`'s sampled flag), so that a trace is whole or absent.
    pub sample_ratio: f64,
    /// Sent with every export: a collector's or vendor's credentials.
    pub headers: Vec<(String, String)>,
    /// How long one export may take, retries included.
    pub timeout: Duration,
}

impl TraceSettings {
    pub const DEFAULT_SERVICE_NAME: &'static str = "prefixlb";
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
}
