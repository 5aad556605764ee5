//! One request's span: its context, passed to the engine, and what the request came to,
//! written as attributes when it ends.

use std::time::{Duration, SystemTime};

use opentelemetry::trace::{Span as _, Status, TraceFlags};
use opentelemetry::KeyValue;
use opentelemetry_sdk::trace::Span;

/// A request's span, from its arrival to its end.
pub struct RequestSpan {
    span: Span,
    /// How long the request waited in line for a slot, when it went through the line.
    queue_wait: Option<Duration>,
}

/// What a request came to, as its span's attributes say it.
#[derive(Debug, Default)]
pub struct Outcome<'a> {
    /// The status the client got; 0 when it went away first.
    pub status: u16,
    pub upstream_status: Option<u16>,
    /// The peer that served the request (`ip:port`).
    pub peer: Option<&'a str>,
    /// How the peer was chosen: the route label of the metrics and the access log.
    pub route: Option<&'static str>,
    /// Where the routing key came from.
    pub key_source: Option<&'static str>,
    /// Milliseconds from the choice of peer to the first byte of its answer.
    pub ttft_ms: Option<u32>,
    /// The prompt's tokens and those the engine said it had cached, when it said.
    pub prompt_tokens: Option<u32>,
    pub cached_tokens: Option<u32>,
    pub request_id: Option<&'a str>,
    /// The client's tenant name (never its key).
    pub tenant: Option<&'a str>,
    /// Peers whose connect failed before one took the request.
    pub failed_connects: usize,
    pub bytes_in: usize,
    pub bytes_out: usize,
    /// Why the request failed, when it did.
    pub error: Option<String>,
}

impl RequestSpan {
    pub(super) fn new(span: Span) -> Self {
        Self {
            span,
            queue_wait: None,
        }
    }

    pub fn waited(&mut self, wait: Duration) {
        self.queue_wait = Some(wait);
    }

    /// The W3C `traceparent` the engine gets: the client's trace (or this one's), with this
    /// span as the parent of the engine's. The sampled flag is the only flag W3C defines.
    pub fn traceparent(&self) -> String {
        let cx = self.span.span_context();
        format!(
            "00-{}-{}-{:02x}",
            cx.trace_id(),
            cx.span_id(),
            cx.trace_flags() & TraceFlags::SAMPLED
        )
    }

    /// The `tracestate` the engine gets: the client's, unchanged (prefixlb adds no entry of its
    /// own); empty when the client sent none or its `traceparent` was not valid.
    pub fn tracestate(&self) -> String {
        self.span.span_context().trace_state().header()
    }

    /// Ends the span with what the request came to. A status of 500 and above, or an error,
    /// marks it failed; a 4xx is the client's, not prefixlb's, as OpenTelemetry's HTTP
    /// conventions have it for a server.
    pub fn end(mut self, outcome: Outcome<'_>) {
        if !self.span.is_recording() {
            return;
        }
        let o = outcome;
        let mut attributes = vec![
            KeyValue::new("http.response.status_code", i64::from(o.status)),
            KeyValue::new("http.request.body.size", o.bytes_in as i64),
            KeyValue::new("http.response.body.size", o.bytes_out as i64),
        ];
        // Labels are static: no copy of them is made.
        for (key, value) in [
            ("prefixlb.route", o.route),
            ("prefixlb.key_source", o.key_source),
        ] {
            if let Some(v) = value {
                attributes.push(KeyValue::new(key, v));
            }
        }
        let texts = [
            ("prefixlb.peer", o.peer),
            ("prefixlb.request_id", o.request_id),
            ("prefixlb.tenant", o.tenant),
        ];
        for (key, value) in texts {
            if let Some(v) = value {
                attributes.push(KeyValue::new(key, v.to_owned()));
            }
        }
        let numbers = [
            ("prefixlb.upstream_status", o.upstream_status.map(u32::from)),
            ("prefixlb.ttft_ms", o.ttft_ms),
            ("prefixlb.prompt_tokens", o.prompt_tokens),
            ("prefixlb.cached_tokens", o.cached_tokens),
        ];
        for (key, value) in numbers {
            if let Some(v) = value {
                attributes.push(KeyValue::new(key, i64::from(v)));
            }
        }
        if let Some(wait) = self.queue_wait {
            let ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
            attributes.push(KeyValue::new("prefixlb.queue_wait_ms", ms));
        }
        if o.failed_connects > 0 {
            attributes.push(KeyValue::new(
                "prefixlb.failed_connects",
                o.failed_connects as i64,
            ));
        }
        self.span.set_attributes(attributes);
        if let Some(e) = o.error {
            self.span.set_status(Status::error(e));
        } else if o.status >= 500 {
            self.span
                .set_status(Status::error(format!("status {}", o.status)));
        }
        self.span.end_with_timestamp(SystemTime::now());
    }
}
