//! The end of a request, however it ended: its slot released, its metrics counted and its
//! access log line written.

use std::sync::Arc;

use pingora::proxy::Session;
use pingora::Error;

use super::client::final_response;
use super::ctx::RequestCtx;
use super::lb::PrefixLb;
use crate::access_log::Entry;
use crate::metrics;
use crate::routing::KeySource;

impl PrefixLb {
    /// Releases the request's slot, counts it and writes its access log line.
    pub(crate) fn finish(&self, session: &Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        let usage = self.settle_usage(ctx);
        // The response has ended or the client has gone: either way the slot is free now.
        let slot = ctx.slot.take();
        let served_by = slot
            .as_ref()
            .map(|s| Arc::clone(s.peer()))
            .or(ctx.released.take());
        drop(slot);
        let duration = ctx.arrived.elapsed();
        metrics::DURATION.observe(duration.as_secs_f64());
        let route = ctx.route_label();
        if let (Some(p), Some(route)) = (served_by.as_ref(), route) {
            let class = metrics::status_class(ctx.upstream_status);
            metrics::count_peer(
                p.id(),
                || p.removed(),
                || {
                    metrics::PEER_REQUESTS
                        .with_label_values(&[p.id(), route, class])
                        .inc()
                },
            );
        }
        let peer = served_by.map(|p| p.id().to_owned());
        self.end_trace(session, e, ctx, peer.as_deref(), usage);
        if !self.access_log.enabled() {
            return;
        }
        let header = session.req_header();
        self.access_log.write(&Entry {
            time: jiff::Timestamp::now().to_string(),
            method: header.method.as_str(),
            path: header.uri.path(),
            status: final_response(session).map_or(0, |r| r.status.as_u16()),
            peer: peer.as_deref(),
            route,
            request_id: ctx.request_id.as_deref(),
            tenant: ctx.client.as_ref().map(|t| t.name()),
            key_source: ctx.key_source.map(KeySource::as_str),
            key_hash: ctx
                .key_source
                .and(ctx.demand.hash)
                .map(|h| self.access_log.key_label(h)),
            ttft_ms: ctx.ttft_ms.map(u64::from),
            duration_ms: duration.as_millis() as u64,
            bytes_in: session.body_bytes_read(),
            bytes_out: session.body_bytes_sent(),
            error: e.map(|e| e.to_string()),
        });
    }
}
