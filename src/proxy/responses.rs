//! Stored Responses API responses: a follow-up naming one goes to the peer that made it, and
//! every response forwarded teaches the proxy where its id lives.

use bytes::Bytes;
use pingora::proxy::Session;

use super::ctx::RequestCtx;
use super::lb::PrefixLb;
use crate::routing::responses::Read;
use crate::routing::{Route, Routed};

impl PrefixLb {
    /// A slot on the peer that made the response `id`, while it is remembered and eligible.
    /// It is taken whatever the peer's load: no other engine could answer. Without one the
    /// request is routed by its key like any other, and an engine without the response
    /// answers 404 itself.
    pub(crate) fn home_of(&self, id: &str) -> Option<Routed> {
        let home = self.responses.home(id)?;
        let cluster = self.router.cluster();
        let peer = cluster.peer(&home).filter(|p| p.eligible())?;
        Some(Routed {
            slot: peer.take(),
            route: Route::Affinity,
            steps: 1,
        })
    }

    /// Starts reading the id of a successful response to a request that creates one.
    pub(crate) fn watch_response(&self, session: &Session, ctx: &mut RequestCtx, status: u16) {
        let header = session.req_header();
        let creates = self
            .router
            .keys
            .is_responses(&header.method, header.uri.path());
        ctx.response_id = (creates && (200..300).contains(&status)).then(Box::default);
    }

    /// Reads a chunk of the response for its id, until it is found or given up.
    pub(crate) fn learn_response(&self, ctx: &mut RequestCtx, chunk: Option<&Bytes>) {
        let (Some(reader), Some(chunk)) = (ctx.response_id.as_mut(), chunk) else {
            return;
        };
        match reader.feed(chunk) {
            Read::More => {}
            Read::None => ctx.response_id = None,
            Read::Id(id) => {
                ctx.response_id = None;
                if let Some(slot) = &ctx.slot {
                    self.responses.learn(&id, slot.peer().id());
                }
            }
        }
    }
}
