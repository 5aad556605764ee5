//! What the proxy keeps of one request between Pingora's hooks.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use super::error::ApiError;
use crate::lifecycle::Request;
use crate::routing::{Demand, IdReader, KeySource, Peer, Route, Routed, Slot, UsageReader};
use crate::tenants::{Tenant, TenantSlot};
use crate::traces::RequestSpan;

pub struct RequestCtx {
    pub(crate) arrived: Instant,
    /// When the current peer was chosen; the first-byte time counts from here.
    pub(crate) chosen: Option<Instant>,
    /// Milliseconds from the choice to the first byte of the answer.
    pub(crate) ttft_ms: Option<u32>,
    /// The status the upstream answered with, if it answered.
    pub(crate) upstream_status: Option<u16>,
    /// Where the key came from, once read; its point is the demand's.
    pub(crate) key_source: Option<KeySource>,
    /// The key's point, the prompt's size and blocks, as the choice of peer prices them. Boxed:
    /// the blocks are most of a context, and every connection's future keeps room for one.
    pub(crate) demand: Box<Demand>,
    /// Passed on to the engine, echoed to the client and logged.
    pub(crate) request_id: Option<String>,
    /// The slot of the peer this attempt goes to. Dropping the context releases it.
    pub(crate) slot: Option<Slot>,
    /// The peer of a slot released early, for the log line.
    pub(crate) released: Option<Arc<Peer>>,
    pub(crate) route: Option<Route>,
    /// Peers whose connect failed for this request; a retry skips them.
    pub(crate) failed: Vec<Arc<Peer>>,
    /// Peeked bytes that Pingora will not replay: sent ahead of the first body chunk of every
    /// attempt.
    pub(crate) unreplayed: Option<Bytes>,
    pub(crate) unreplayed_due: bool,
    /// This request's share of the peek memory, held until the engine answers (no retry can
    /// follow then) or the request ends.
    pub(crate) peek_held: Option<super::peek::Held>,
    /// The client asked for 100 Continue and got it from here: the upstream must not be asked.
    pub(crate) continued: bool,
    /// The client's tenant, when API keys are on: named in the log even when refused.
    pub(crate) client: Option<Arc<Tenant>>,
    /// The tenant's hold on one of its concurrent requests, once admitted.
    pub(crate) tenant: Option<TenantSlot>,
    /// Reads the id of the Responses API response being forwarded, to learn where it lives.
    pub(crate) response_id: Option<Box<IdReader>>,
    /// Reads what the engine says it had cached of the prompt, from its answer.
    pub(crate) usage: Option<Box<UsageReader>>,
    /// The descriptor of this attempt's connection to the engine, for the stream's watchdog.
    pub(crate) upstream_fd: Option<std::os::fd::RawFd>,
    /// The answer is a server-sent event stream.
    pub(crate) event_stream: bool,
    /// Ends the stream when the engine falls silent half-way (from its first body byte on).
    pub(crate) stall: Option<super::stall::StallGuard>,
    /// The error to answer with, when a hook failed on purpose. Boxed: a failing request can
    /// afford the allocation, and every context kept 72 bytes for it.
    pub(crate) error: Option<Box<ApiError>>,
    /// The request's span, when traces are on: boxed, a word here when they are off.
    pub(crate) trace: Option<Box<RequestSpan>>,
    /// Keeps a draining process alive until the request ends.
    _serving: Request,
}

impl RequestCtx {
    pub(crate) fn new(serving: Request) -> Self {
        Self {
            arrived: Instant::now(),
            chosen: None,
            ttft_ms: None,
            upstream_status: None,
            key_source: None,
            demand: Box::default(),
            request_id: None,
            slot: None,
            released: None,
            route: None,
            failed: Vec::new(),
            unreplayed: None,
            unreplayed_due: false,
            peek_held: None,
            continued: false,
            client: None,
            tenant: None,
            response_id: None,
            usage: None,
            upstream_fd: None,
            event_stream: false,
            stall: None,
            error: None,
            trace: None,
            _serving: serving,
        }
    }

    pub(crate) fn take_slot(&mut self, routed: Routed) {
        self.route = Some(routed.route);
        self.slot = Some(routed.slot);
        self.chosen = Some(Instant::now());
    }

    /// How the current peer was chosen, as the metrics and the access log name it.
    pub(crate) fn route_label(&self) -> Option<&'static str> {
        if !self.failed.is_empty() {
            return Some("retry");
        }
        self.route.map(Route::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every connection's future keeps room for a context, in several places: an 800-byte
    /// `Demand` held in it cost 6 KiB an open stream (`cargo bench --bench memory`).
    #[test]
    fn a_context_stays_small() {
        let size = std::mem::size_of::<RequestCtx>();
        assert!(size <= 384, "RequestCtx is {size} bytes");
        assert!(
            std::mem::size_of::<Demand>() > 384,
            "Demand is small now: RequestCtx need not box it"
        );
    }
}
