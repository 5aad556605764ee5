//! The Pingora side: a `ProxyHttp` whose hooks only hand the request to the routing core and
//! keep the slot it returns for as long as the response runs.
//!
//! `request_filter` runs the request through a chain of steps, each in its own file, each of
//! which lets it go on or stops it with the answer (`answer::Stop`): `admission` on the headers
//! (the tenant, the path); `models`, the model list prefixlb serves itself; the `gate` (the
//! body's size, the key peeked from it, the prompt charged to its tenant); the `route` (the
//! pool, then a slot: on the peer holding the stored response a Responses request continues, at
//! once, or in the waiting line). `upstream_peer` turns the slot into an
//! `HttpPeer`; `fail_to_connect` gives the slot back and marks the peer failed for this
//! request, so the next call picks another; `logging` (and, as a backstop, dropping the
//! context) releases the slot when the response has ended or the client has gone.

mod admission;
mod answer;
mod client;
mod ctx;
pub mod error;
mod finish;
mod forwarding;
mod gate;
mod idle;
mod lb;
mod models;
pub mod peek;
mod progress;
mod responses;
mod route;
pub mod service;
pub mod shared_load;
mod stall;
mod trace;
mod upstream;
mod usage;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use pingora::prelude::*;
use pingora::proxy::FailToProxy;
use pingora::Error;

use crate::metrics;
use crate::routing::{is_peer_fault, Decision, Rejection};
use answer::{fail, reject, Stop};
use client::final_response;
use ctx::RequestCtx;
use error::{status_for, ApiError};
pub use lb::PrefixLb;
use upstream::send_unreplayed;

#[async_trait]
impl ProxyHttp for PrefixLb {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx::new(self.activity.request())
    }

    // Pingora adds a response-compression module, disabled, to every request unless told
    // otherwise; prefixlb compresses nothing (token streams must flush as they come), so it
    // would only cost each request its context and a filter call per chunk.
    fn init_downstream_modules(&self, _modules: &mut pingora::modules::http::HttpModules) {}

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        session.set_write_timeout(Some(self.settings.client_write_timeout));
        // Requests a client sends before reading the answer to the one before are answered in
        // turn, instead of being dropped with the connection.
        session.set_pipelining_enabled(true);
        ctx.request_id = self.forwarding.request_id(&session.req_header().headers);
        self.begin_trace(session, ctx);
        let steps = async {
            self.admit(session, ctx)?;
            // With pools, the model list is prefixlb's to answer, and the model picks the pool.
            let pooled = self.router.cluster().pools().active();
            self.list_models(session, pooled)?;
            let prompt = self.gate(session, ctx, pooled).await?;
            self.route(session, ctx, pooled, &prompt).await
        };
        match steps.await {
            Ok(()) => return Ok(false),
            Err(Stop::Error(api)) => self.answer(session, ctx, &api).await?,
            Err(Stop::Models(names)) => self.answer_models(session, ctx, &names).await?,
            Err(Stop::Failed(e)) => return Err(e),
        }
        Ok(true)
    }

    async fn upstream_peer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        if ctx.slot.is_none() {
            // A retry after a failed connect: the next peer on the walk, in line if all are full.
            match self.choose_now(session, ctx) {
                Decision::Routed(routed) => ctx.take_slot(routed),
                Decision::Saturated => {
                    if let Err(why) = self.wait_to_retry(ctx).await {
                        return Err(reject(ctx, why));
                    }
                }
                Decision::NoPeer => return Err(reject(ctx, Rejection::NoPeer)),
            }
        }
        let Some(slot) = ctx.slot.as_ref() else {
            return Err(fail(ctx, ApiError::from_status(500)));
        };
        // Each attempt's body starts again from the replayed bytes: put ours in front of them.
        ctx.unreplayed_due = ctx.unreplayed.is_some();
        Ok(Box::new(self.http_peer(slot.peer())))
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        if let Some(slot) = ctx.slot.take() {
            let p = slot.peer();
            metrics::count_on_peer(&metrics::PEER_CONNECT_FAILURES, p.id(), || p.removed());
            self.peer_failed(slot.peer());
            ctx.failed.push(Arc::clone(slot.peer()));
        }
        // Nothing has reached the client yet, so another peer is safe to try.
        e.set_retry(ctx.failed.len() <= self.settings.upstream.connect_retries);
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        _ctx: &mut RequestCtx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        // Once response bytes reached the client, or the body cannot be replayed, a retry
        // would corrupt the response or the request.
        if final_response(session).is_some()
            || !session.req_header().method.is_idempotent()
            || session.retry_buffer_truncated()
        {
            e.set_retry(false);
        } else {
            e.retry.decide_reuse(client_reused);
        }
        e
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.upstream_request(session, upstream_request, ctx)
    }

    async fn upstream_response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        ctx.upstream_status = Some(upstream_response.status.as_u16());
        self.header_came(ctx, upstream_response);
        self.watch_response(session, ctx, upstream_response.status.as_u16());
        self.watch_usage(ctx, upstream_response.status.as_u16());
        // Once the engine answers, no other attempt follows: the bytes kept for one, and their
        // share of the peek memory, can go (once the first body chunk has carried them).
        if !ctx.unreplayed_due {
            ctx.unreplayed = None;
            ctx.peek_held = None;
        }
        if let Some(slot) = &ctx.slot {
            if is_peer_fault(upstream_response.status.as_u16()) {
                self.peer_failed(slot.peer());
            } else {
                slot.peer().record_success();
            }
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.client_response(session, upstream_response, ctx)
    }

    async fn request_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        _end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        send_unreplayed(ctx, body);
        let limit = self.settings.peek.max_body;
        if session.body_bytes_read() > limit {
            return Err(fail(ctx, ApiError::body_too_large(limit)));
        }
        Ok(())
    }

    fn upstream_response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<Duration>> {
        self.chunk_came(ctx, body.as_ref(), end_of_stream);
        self.learn_response(ctx, body.as_ref());
        self.read_usage(ctx, body.as_ref());
        if ctx.ttft_ms.is_none() && body.as_ref().is_some_and(|b| !b.is_empty()) {
            if let Some(chosen) = ctx.chosen {
                let ttfb = chosen.elapsed();
                metrics::FIRST_BYTE.observe(ttfb.as_secs_f64());
                ctx.ttft_ms = Some(u32::try_from(ttfb.as_millis()).unwrap_or(u32::MAX));
                if let Some(slot) = ctx.slot.as_mut() {
                    slot.prefilled();
                }
            }
        }
        Ok(None)
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        _reused: bool,
        _peer: &HttpPeer,
        fd: std::os::unix::io::RawFd,
        _digest: Option<&pingora::protocols::Digest>,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.connected(ctx, fd);
        Ok(())
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        self.finish(session, e, ctx);
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
        let api = match ctx.error.take() {
            Some(api) => *api,
            None => match status_for(e) {
                0 => {
                    return FailToProxy {
                        error_code: 0,
                        can_reuse_downstream: false,
                    }
                }
                status => ApiError::from_status(status),
            },
        };
        // The request is over for the peer: free its slot before lingering on the client.
        if let Some(slot) = ctx.slot.take() {
            ctx.released = Some(Arc::clone(slot.peer()));
        }
        if final_response(session).is_none() {
            if let Err(write) = self.answer(session, ctx, &api).await {
                log::debug!("could not send the error response: {write}");
            }
        } else {
            self.end_stream(session, ctx, e).await;
        }
        FailToProxy {
            error_code: api.status,
            can_reuse_downstream: false,
        }
    }
}
