//! What goes upstream and what comes back: the peer with its timeouts, the request's headers and
//! first body bytes as the engine gets them, the response's headers as the client gets them.

use bytes::{Bytes, BytesMut};
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;
use pingora::Result;

use super::client::client_ip;
use super::ctx::RequestCtx;
use super::lb::PrefixLb;
use super::peek::declared_length;
use crate::routing::Peer;

impl PrefixLb {
    /// The connection to `peer`, with the upstream timeouts.
    pub(crate) fn http_peer(&self, peer: &Peer) -> HttpPeer {
        let up = &self.settings.upstream;
        let mut http = crate::tls::http_peer(peer, &up.tls);
        up.apply_to(&mut http.options);
        http
    }

    /// The request's headers as the engine gets them.
    pub(crate) fn upstream_request(
        &self,
        session: &Session,
        upstream_request: &mut RequestHeader,
        ctx: &RequestCtx,
    ) -> Result<()> {
        if ctx.continued {
            upstream_request.remove_header(&http::header::EXPECT);
        }
        if self.auth.as_ref().is_some_and(|a| !a.forward_key) {
            upstream_request.remove_header(&http::header::AUTHORIZATION);
        }
        let tls = session.digest().is_some_and(|d| d.ssl_digest.is_some());
        self.forwarding.apply(
            upstream_request,
            client_ip(session),
            tls,
            ctx.request_id.as_deref(),
        )?;
        super::trace::propagate(ctx, upstream_request)?;
        // A length sent as `42, 42` (or twice) goes upstream once: servers may refuse the list.
        let lengths = upstream_request
            .headers
            .get_all(http::header::CONTENT_LENGTH);
        let listed =
            lengths.iter().count() > 1 || lengths.iter().any(|v| v.as_bytes().contains(&b','));
        if listed {
            if let Some(n) = declared_length(&session.req_header().headers) {
                upstream_request.insert_header(http::header::CONTENT_LENGTH, n.to_string())?;
            }
        }
        Ok(())
    }

    /// The response's headers as the client gets them.
    pub(crate) fn client_response(
        &self,
        session: &mut Session,
        upstream_response: &mut ResponseHeader,
        ctx: &RequestCtx,
    ) -> Result<()> {
        // A 1.0 client cannot read chunked framing: a body of unknown length (an SSE stream)
        // reaches it delimited by the close instead.
        if session.req_header().version == http::Version::HTTP_10
            && !upstream_response
                .headers
                .contains_key(http::header::CONTENT_LENGTH)
        {
            upstream_response.remove_header(&http::header::TRANSFER_ENCODING);
            session.set_keepalive(None);
        }
        if let (Some(name), Some(id)) = (self.forwarding.request_id_header(), &ctx.request_id) {
            upstream_response.insert_header(name.clone(), id.as_str())?;
        }
        Ok(())
    }
}

/// Puts the peeked bytes Pingora does not replay in front of an attempt's first body chunk.
pub fn send_unreplayed(ctx: &mut RequestCtx, body: &mut Option<Bytes>) {
    let Some(front) = ctx.unreplayed_due.then(|| ctx.unreplayed.clone()).flatten() else {
        return;
    };
    ctx.unreplayed_due = false;
    *body = Some(match body.take() {
        Some(rest) if !rest.is_empty() => {
            let mut joined = BytesMut::with_capacity(front.len() + rest.len());
            joined.extend_from_slice(&front);
            joined.extend_from_slice(&rest);
            joined.freeze()
        }
        _ => front,
    });
}
