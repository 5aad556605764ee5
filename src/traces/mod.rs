//! Traces: a span for each request, begun where the client's W3C `traceparent` says (a trace of
//! its own otherwise), handed to the engine as the parent of its work, and sent to an
//! OpenTelemetry collector over OTLP/HTTP (protobuf) once the request has ended, with the
//! routing decision as its attributes.
//!
//! Off unless `tracing` is configured, and then nothing is made: the proxy holds no [`Traces`]
//! and a request's context holds no span. The exporter starts in a background service, after
//! Pingora has daemonized (threads do not survive the fork); requests that arrive before it
//! has are not traced. Spans are queued to the SDK's batch processor, whose thread sends them;
//! a full queue drops spans rather than slowing a request.

mod export;
mod span;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanKind, Tracer as _, TracerProvider as _};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::settings::TraceSettings;
pub use span::{Outcome, RequestSpan};

/// The process's traces: its settings until the exporter runs, then the tracer.
pub struct Traces {
    settings: TraceSettings,
    /// Set once the exporter runs.
    tracer: OnceLock<SdkTracer>,
}

/// The exporter's provider once it runs, for [`drain`]: like the access log, the process has
/// one, and its exits (the drain's end, the server's) are not where the proxy is.
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

impl Traces {
    pub fn new(settings: TraceSettings) -> Arc<Self> {
        Arc::new(Self {
            settings,
            tracer: OnceLock::new(),
        })
    }

    /// The span of a request with these headers, begun now; `None` until the exporter runs.
    /// Named as OpenTelemetry's HTTP conventions name a server span: method and route (the
    /// paths prefixlb forwards are few: its allowed paths).
    pub fn begin(
        &self,
        method: &str,
        path: &str,
        headers: &http::HeaderMap,
    ) -> Option<Box<RequestSpan>> {
        let tracer = self.tracer.get()?;
        let parent = TraceContextPropagator::new().extract(&Headers(headers));
        let span = tracer
            .span_builder(format!("{method} {path}"))
            .with_kind(SpanKind::Server)
            .with_start_time(SystemTime::now())
            .with_attributes([
                KeyValue::new("http.request.method", method.to_owned()),
                KeyValue::new("url.path", path.to_owned()),
            ])
            .start_with_context(tracer, &parent);
        Some(Box::new(RequestSpan::new(span)))
    }

    /// Starts the exporter and its batch processor's thread.
    fn start(&self) -> Result<(), String> {
        let s = &self.settings;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(export::Client::new(s.timeout)?)
            .with_endpoint(s.endpoint.to_string())
            .with_protocol(Protocol::HttpBinary)
            .with_timeout(s.timeout)
            .with_headers(s.headers.iter().cloned().collect())
            .build()
            .map_err(|e| e.to_string())?;
        let resource = Resource::builder()
            .with_service_name(s.service_name.clone())
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                s.sample_ratio,
            ))))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("prefixlb");
        PROVIDER
            .set(provider)
            .map_err(|_| "started twice".to_owned())?;
        self.tracer
            .set(tracer)
            .map_err(|_| "started twice".to_owned())
    }
}

/// Sends the spans still queued, waiting at most `limit`: called before the process exits,
/// once its requests have ended.
pub fn drain(limit: Duration) {
    if let Some(provider) = PROVIDER.get() {
        if let Err(e) = provider.shutdown_with_timeout(limit) {
            log::warn!("traces: the last spans may be lost: {e}");
        }
    }
}

/// Starts the exporter once the server runs (after daemonizing), and then has nothing to do.
pub struct Exporter(pub Arc<Traces>);

#[async_trait]
impl BackgroundService for Exporter {
    async fn start(&self, _shutdown: ShutdownWatch) {
        match self.0.start() {
            Ok(()) => log::info!("traces: sending spans to {}", self.0.settings.endpoint),
            Err(e) => log::error!("traces: not sent, the exporter did not start: {e}"),
        }
    }
}

/// A request's headers, as the W3C propagator reads them.
struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

/// What `begin` makes of a parent context, for the tests: the same trace and span ids.
#[cfg(test)]
fn parent_of(headers: &http::HeaderMap) -> opentelemetry::Context {
    TraceContextPropagator::new().extract(&Headers(headers))
}

#[cfg(test)]
mod tests {
    use opentelemetry::trace::TraceContextExt;

    use super::*;

    #[test]
    fn a_valid_traceparent_is_read_and_an_invalid_one_is_not() {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            "traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
                .parse()
                .unwrap(),
        );
        headers.insert("tracestate", "vendor=abc".parse().unwrap());
        let cx = parent_of(&headers);
        let parent = cx.span().span_context().clone();
        assert_eq!(
            parent.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(parent.span_id().to_string(), "b7ad6b7169203331");
        assert!(parent.is_sampled());
        assert_eq!(parent.trace_state().header(), "vendor=abc");
        headers.insert("traceparent", "00-zz-b7ad6b7169203331-01".parse().unwrap());
        assert!(!parent_of(&headers).span().span_context().is_valid());
    }
}
