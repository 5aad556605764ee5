//! The request's span, when traces are on: begun as the request arrives, its context handed to
//! the engine with each attempt, ended with what the request came to. With traces off every
//! step is a test of an `Option` and nothing else: no span, and the client's `traceparent`
//! reaches the engine as it came, like any other header.

use pingora::http::RequestHeader;
use pingora::proxy::Session;
use pingora::Error;

use super::client::final_response;
use super::ctx::RequestCtx;
use super::lb::PrefixLb;
use crate::routing::{KeySource, Usage};
use crate::traces::Outcome;

impl PrefixLb {
    /// Begins the request's span, a child of the client's when it sent a valid `traceparent`.
    pub(crate) fn begin_trace(&self, session: &Session, ctx: &mut RequestCtx) {
        if let Some(traces) = &self.traces {
            let head = session.req_header();
            ctx.trace = traces.begin(head.method.as_str(), head.uri.path(), &head.headers);
        }
    }

    /// Ends the request's span with the routing decision and its outcome: `peer` served it,
    /// and the engine reported `usage` of its prompt.
    pub(crate) fn end_trace(
        &self,
        session: &Session,
        e: Option<&Error>,
        ctx: &mut RequestCtx,
        peer: Option<&str>,
        usage: Option<Usage>,
    ) {
        let Some(span) = ctx.trace.take() else {
            return;
        };
        span.end(Outcome {
            status: final_response(session).map_or(0, |r| r.status.as_u16()),
            upstream_status: ctx.upstream_status,
            peer,
            route: ctx.route_label(),
            key_source: ctx.key_source.map(KeySource::as_str),
            ttft_ms: ctx.ttft_ms,
            prompt_tokens: usage.map(|u| u.prompt_tokens),
            cached_tokens: usage.map(|u| u.cached_tokens),
            request_id: ctx.request_id.as_deref(),
            tenant: ctx.client.as_ref().map(|t| t.name()),
            failed_connects: ctx.failed.len(),
            bytes_in: session.body_bytes_read(),
            bytes_out: session.body_bytes_sent(),
            error: e.map(|e| e.to_string()),
        });
    }
}

/// Hands the trace to the engine with this span as the parent of its work. W3C has a
/// `tracestate` go with the `traceparent` it was sent with, so the client's goes only with its
/// own trace, and none with a trace begun here.
pub fn propagate(ctx: &RequestCtx, upstream: &mut RequestHeader) -> pingora::Result<()> {
    let Some(span) = ctx.trace.as_deref() else {
        return Ok(());
    };
    upstream.insert_header("traceparent", span.traceparent())?;
    let state = span.tracestate();
    if state.is_empty() {
        upstream.remove_header("tracestate");
    } else {
        upstream.insert_header("tracestate", state)?;
    }
    Ok(())
}
