//! Reading just enough of a request body to find its routing key, without losing a byte of it.
//!
//! Pingora forwards the bytes a filter already read only from its retry buffer, which holds
//! 64 KiB: once more was read it is dropped, and a body read to its end before forwarding starts
//! would reach the upstream as headers alone. So the peek keeps its own copy, and
//! - a body that fits the retry buffer is replayed by Pingora itself;
//! - a longer `Content-Length` body is never read to its end here (the peek stops while more
//!   than one read remains), so forwarding reads on and `request_body_filter` puts the copy back
//!   in front of the first chunk it sees;
//! - a chunked body, whose end cannot be foreseen, is peeked only while the next read, judged by
//!   the last one, still fits the retry buffer.

use bytes::{Bytes, BytesMut};
use pingora::proxy::Session;

use super::error::ApiError;
use crate::routing::{BodyEnd, Extract, KeyExtractor, RequestParts, RoutingKey};

/// Pingora's retry buffer (`BODY_BUF_LIMIT`, private to pingora-core).
pub const REPLAY_BUFFER: usize = 64 * 1024;
/// The most one body read returns (Pingora's `BODY_BUFFER_SIZE`).
const MAX_READ: usize = 64 * 1024;

#[derive(Debug)]
pub struct Peeked {
    pub key: RoutingKey,
    /// Body bytes read to find the key.
    pub bytes: usize,
    /// The bytes read, when Pingora will not replay them: forwarding must send them first.
    pub reinject: Option<Bytes>,
}

#[derive(Debug, Clone, Copy)]
pub struct PeekLimits {
    pub peek_limit: usize,
    pub max_body: usize,
}

/// Reads the body of a prompt-carrying request until its key is complete, the body ends or a
/// limit is reached. `Ok(Err(_))` is an error to answer the client with.
pub async fn peek_key(
    session: &mut Session,
    keys: &KeyExtractor,
    limits: PeekLimits,
) -> pingora::Result<Result<Peeked, ApiError>> {
    let content_length = declared_length(session);
    let client = session
        .client_addr()
        .and_then(|a| a.as_inet())
        .map(|a| a.ip());
    session.enable_retry_buffering();
    let mut buf = BytesMut::new();
    let (mut last_read, mut next_attempt) = (0usize, 0usize);
    let key = loop {
        let done = session.is_body_done();
        let may_read = !done
            && buf.len() < limits.peek_limit
            && match content_length {
                Some(len) if len > REPLAY_BUFFER => len.saturating_sub(buf.len()) > MAX_READ,
                Some(_) => true,
                None => buf.len() + 2 * last_read.max(1) <= REPLAY_BUFFER,
            };
        let end = if done {
            BodyEnd::Complete
        } else if may_read {
            BodyEnd::More
        } else {
            BodyEnd::Limit
        };
        // Parsing again on every small chunk of a trickled body would be quadratic: wait until
        // the buffer has grown by half, unless this is the last look.
        if end != BodyEnd::More || buf.len() >= next_attempt {
            let header = session.req_header();
            let parts = RequestParts {
                method: &header.method,
                path: header.uri.path(),
                headers: &header.headers,
                client,
                body: &buf,
                end,
            };
            match keys.key_for(&parts) {
                Extract::Key(key) => break key,
                Extract::NeedMore => next_attempt = buf.len() + (buf.len() / 2).max(1024),
            }
        }
        if let Some(chunk) = session.read_request_body().await? {
            last_read = chunk.len();
            buf.extend_from_slice(&chunk);
            if buf.len() > limits.max_body {
                return Ok(Err(ApiError::body_too_large(limits.max_body)));
            }
        }
    };
    let bytes = buf.len();
    if !session.retry_buffer_truncated() {
        return Ok(Ok(Peeked {
            key,
            bytes,
            reinject: None,
        }));
    }
    if session.is_body_done() {
        // Only a chunked body whose last read was far larger than the one before can get here:
        // it is all read, Pingora holds none of it, and forwarding would send headers alone.
        return Ok(Err(ApiError {
            status: 411,
            kind: "invalid_request_error",
            code: "length_required",
            message: "this chunked body could not be forwarded intact; send it with Content-Length"
                .into(),
            retry_after_secs: None,
        }));
    }
    log::debug!("peeked {bytes} body bytes past the replay buffer: re-injecting them");
    Ok(Ok(Peeked {
        key,
        bytes,
        reinject: Some(buf.freeze()),
    }))
}

/// The body length the client declared, if it declared one.
pub fn declared_length(session: &Session) -> Option<usize> {
    session
        .req_header()
        .headers
        .get(http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}
