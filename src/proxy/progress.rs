//! What the proxy tells the routing core of an engine's progress (each byte of its answers),
//! the watchdog of a streamed answer once it has begun, and how a stream that ends early is
//! told to the client: an OpenAI-style error event, the last of the stream, instead of a
//! connection cut in the middle of a chunk.

use std::os::fd::RawFd;

use bytes::Bytes;
use pingora::http::ResponseHeader;
use pingora::proxy::Session;
use pingora::{Error, ErrorSource, ErrorType};

use super::client::final_response;
use super::ctx::RequestCtx;
use super::error::ApiError;
use super::lb::PrefixLb;
use super::stall::StallGuard;
use crate::metrics;
use crate::routing::BodyKind;

impl PrefixLb {
    /// The engine's response header came.
    pub(crate) fn header_came(&self, ctx: &mut RequestCtx, header: &ResponseHeader) {
        ctx.event_stream = is_event_stream(header);
        if let Some(slot) = &ctx.slot {
            slot.peer().advanced();
        }
    }

    /// A chunk of the engine's answer came: the peer moves, and a stream that has begun is
    /// watched from here on.
    pub(crate) fn chunk_came(&self, ctx: &mut RequestCtx, chunk: Option<&Bytes>, end: bool) {
        if end {
            // The connection may go back to the pool now, for another request to use.
            ctx.stall = None;
        }
        if chunk.is_none_or(|c| c.is_empty()) {
            return;
        }
        if let Some(slot) = &ctx.slot {
            slot.peer().advanced();
        }
        match (&ctx.stall, ctx.upstream_fd) {
            (Some(guard), _) => guard.advanced(),
            (None, Some(fd)) if ctx.event_stream && !end => {
                let limit = self.settings.upstream.stream_idle_timeout;
                if !limit.is_zero() {
                    ctx.stall = StallGuard::arm(fd, limit);
                }
            }
            _ => {}
        }
    }

    /// A connection to the engine is this attempt's (new or reused).
    pub(crate) fn connected(&self, ctx: &mut RequestCtx, fd: RawFd) {
        ctx.upstream_fd = Some(fd);
        ctx.stall = None;
    }

    /// Ends a streamed answer the engine left unfinished with an error event the client can
    /// read, when the answer had begun as an event stream. On HTTP/1 the body itself is left
    /// without its end: Pingora closes a connection whose upstream failed, and a body that
    /// looked whole would let the client put the connection back in its pool and send its
    /// next request into that close (its status line was long sent, too late for
    /// `Connection: close`). Cut, the body tells the client not to reuse the connection. An
    /// HTTP/2 stream ends whole: the connection stays, and a stream reset would discard the
    /// event still queued ahead of it.
    pub(crate) async fn end_stream(&self, session: &mut Session, ctx: &RequestCtx, e: &Error) {
        if !final_response(session).is_some_and(is_event_stream) {
            return;
        }
        let upstream = &self.settings.upstream;
        let (reason, api) = if ctx.stall.as_ref().is_some_and(StallGuard::fired) {
            (
                "stalled",
                ApiError::stream_stalled(upstream.stream_idle_timeout),
            )
        } else if e.esource() == &ErrorSource::Downstream {
            // The client's side failed: nothing of the engine's to count or to tell.
            return;
        } else if e.etype() == &ErrorType::ReadTimedout {
            ("stalled", ApiError::stream_stalled(upstream.read_timeout))
        } else {
            ("broken", ApiError::stream_broken(e))
        };
        metrics::STREAM_ERRORS.with_label_values(&[reason]).inc();
        let head = session.req_header();
        let event = if self.router.keys.body_kind(&head.method, head.uri.path())
            == Some(BodyKind::Messages)
        {
            api.messages_stream_event()
        } else {
            api.stream_event()
        };
        let whole = session.as_downstream().is_http2();
        if let Err(write) = session.write_response_body(Some(event), whole).await {
            log::debug!("could not send the stream's error event: {write}");
        }
    }
}

fn is_event_stream(header: &ResponseHeader) -> bool {
    header
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"))
}
