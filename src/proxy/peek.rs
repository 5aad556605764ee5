//! Reading a request body's prompt, to find its routing key and name its blocks, without losing
//! a byte of it, and with a key that depends only on the body's bytes, never on how they
//! arrived.
//!
//! The key is read from at most the first `peek_limit` bytes: a key complete before that is
//! complete; past it the key is what those bytes hold, cut at exactly that offset. The rest of
//! the prompt is read as far as the same window, while the body keeps coming.
//!
//! Pingora forwards bytes a filter already read only from its retry buffer, which holds 64
//! KiB from the moment it is enabled and drops everything once more arrives; and a body read
//! to its end before forwarding, of which Pingora holds nothing, would go upstream as headers
//! alone. So for a `Content-Length` body the retry buffer is enabled only once at most 64 KiB
//! remain: whatever is read from then on, up to the end, it holds. The bytes read before that
//! are kept here and sent ahead of the first chunk Pingora forwards. A chunked body, whose end
//! cannot be foreseen, is buffered from the start and read only while the next read, judged by
//! the last one, still fits.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::{CONTENT_LENGTH, EXPECT};
use http::HeaderMap;
use pingora::proxy::Session;

use super::client::client_ip;
use super::error::ApiError;
use crate::metrics;
use crate::routing::{
    model_in, previous_in, BodyEnd, Extract, FallbackReason, KeyExtractor, RequestParts, RoutingKey,
};
use crate::settings::PeekLimits;

/// Pingora's retry buffer (`BODY_BUF_LIMIT`, private to pingora-core).
pub const REPLAY_BUFFER: usize = 64 * 1024;

/// Body bytes held for peeks across all requests, against a cap: many slow clients, each with a
/// window of body read and Pingora's retry copy of it, must not be able to exhaust memory.
#[derive(Debug)]
pub struct PeekMemory {
    used: AtomicUsize,
    limit: usize,
}

impl PeekMemory {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            used: AtomicUsize::new(0),
            limit,
        })
    }

    fn hold(self: &Arc<Self>) -> Held {
        Held {
            memory: Arc::clone(self),
            bytes: 0,
        }
    }
}

/// One request's share of [`PeekMemory`], given back when it is dropped.
#[derive(Debug)]
pub struct Held {
    memory: Arc<PeekMemory>,
    bytes: usize,
}

impl Held {
    /// Takes `n` more bytes of the budget; false, taking nothing, when that would exceed it.
    fn grow(&mut self, n: usize) -> bool {
        let m = &self.memory;
        let taken = m
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |used| {
                used.checked_add(n).filter(|&after| after <= m.limit)
            })
            .is_ok();
        if taken {
            self.bytes += n;
            metrics::PEEK_MEMORY.add(n as i64);
        }
        taken
    }

    fn shrink_to(&mut self, n: usize) {
        let freed = self.bytes.saturating_sub(n);
        self.memory.used.fetch_sub(freed, Ordering::AcqRel);
        metrics::PEEK_MEMORY.sub(freed as i64);
        self.bytes -= freed;
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

#[derive(Debug)]
pub struct Peeked {
    pub key: RoutingKey,
    /// The model the body asks for, when it was looked for and found within the window.
    pub model: Option<String>,
    /// The stored response a Responses request continues, when it names one within the window.
    pub previous: Option<String>,
    /// Body bytes read to find the key.
    pub bytes: usize,
    /// The leading bytes read that Pingora's retry buffer does not hold: forwarding must send
    /// them first, on every attempt.
    pub unreplayed: Option<Bytes>,
    /// The peek memory still held for this request, until the engine answers: the unreplayed
    /// bytes and Pingora's retry copy.
    pub held: Held,
}

/// Reads the body of a prompt-carrying request until its key is complete, the body ends or a
/// limit is reached. `Ok(Err(_))` is an error to answer the client with.
pub async fn peek_key(
    session: &mut Session,
    keys: &KeyExtractor,
    limits: PeekLimits,
    memory: &Arc<PeekMemory>,
    want_model: bool,
) -> pingora::Result<Result<Peeked, ApiError>> {
    let declared = declared_length(&session.req_header().headers);
    let client = client_ip(session);
    if expects_continue(session) {
        // The body is read before any upstream could answer 100 Continue: answer it here.
        session
            .write_continue_response()
            .await
            .map_err(|e| e.into_down())?;
    }
    // Bytes read before the retry buffer was enabled; all of them while it is not.
    let mut buffered_from: Option<usize> = None;
    if declared.is_none_or(|len| len <= REPLAY_BUFFER) {
        session.enable_retry_buffering();
        buffered_from = Some(0);
    }
    let header = session.req_header();
    let want_previous = keys.is_responses(&header.method, header.uri.path());
    // With pools, reading goes on until the model is found too (it may come after the
    // messages), and for a Responses request until the response it continues, within the
    // same limits.
    let found = |body: &[u8]| {
        (!want_model || model_in(body).is_some()) && (!want_previous || previous_in(body).is_some())
    };
    let window = limits.peek_limit;
    let mut held = memory.hold();
    let mut buf = BytesMut::new();
    let (mut last_read, mut next_attempt) = (0usize, 0usize);
    let key = loop {
        let done = session.is_body_done();
        let replay_safe = declared.is_some() || buf.len() + 2 * last_read.max(1) <= REPLAY_BUFFER;
        let may_read = !done && buf.len() < window && replay_safe;
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
            // Stopped short of the window only to keep the body replayable: a key cut there
            // would depend on how the bytes arrived, so an incomplete one falls back instead.
            let short = end == BodyEnd::Limit && buf.len() < window;
            // A body that ended past the window is still seen only up to the window: cut.
            let end = match end {
                BodyEnd::Complete if buf.len() > window => BodyEnd::Limit,
                _ if short => BodyEnd::More,
                end => end,
            };
            let header = session.req_header();
            let parts = RequestParts {
                method: &header.method,
                path: header.uri.path(),
                headers: &header.headers,
                client,
                body: &buf[..buf.len().min(window)],
                end,
            };
            match keys.key_for(&parts) {
                Extract::Key(key) if !may_read || found(parts.body) => break key,
                // A complete key stands; the rest of the prompt is read while the body may be,
                // to name its deeper blocks.
                Extract::Deeper(key) if !may_read || short => break key,
                Extract::Key(_) | Extract::Deeper(_) => {
                    next_attempt = buf.len() + (buf.len() / 2).max(1024)
                }
                Extract::NeedMore if short => {
                    break keys.key_without_prompt(
                        &header.headers,
                        client,
                        FallbackReason::PeekLimit,
                    )
                }
                Extract::NeedMore => next_attempt = buf.len() + (buf.len() / 2).max(1024),
            }
        }
        if buffered_from.is_none() && declared.is_some_and(|len| len - buf.len() <= REPLAY_BUFFER) {
            session.enable_retry_buffering();
            buffered_from = Some(buf.len());
        }
        let chunk = session
            .read_request_body()
            .await
            .map_err(|e| e.into_down())?;
        if let Some(chunk) = chunk {
            // Ours, and Pingora's retry copy once it buffers.
            let copies = 1 + usize::from(buffered_from.is_some());
            if !held.grow(chunk.len() * copies) {
                metrics::REJECTIONS
                    .with_label_values(&["peek_memory"])
                    .inc();
                return Ok(Err(ApiError::peek_memory_exhausted()));
            }
            last_read = chunk.len();
            buf.extend_from_slice(&chunk);
            if buf.len() > limits.max_body {
                return Ok(Err(ApiError::body_too_large(limits.max_body)));
            }
        }
    };
    let bytes = buf.len();
    let model = want_model
        .then(|| model_in(&buf[..bytes.min(window)]))
        .flatten();
    let previous = want_previous
        .then(|| previous_in(&buf[..bytes.min(window)]))
        .flatten();
    let unreplayed = if session.retry_buffer_truncated() {
        if session.is_body_done() {
            // Only a chunked body whose last read was far larger than the one before gets
            // here: it is all read, Pingora holds none of it, and forwarding would send headers
            // alone.
            return Ok(Err(ApiError {
                status: 411,
                kind: "invalid_request_error",
                code: "length_required",
                message:
                    "this chunked body could not be forwarded intact; send it with Content-Length"
                        .into(),
                retry_after_secs: None,
            }));
        }
        bytes
    } else {
        buffered_from.unwrap_or(bytes)
    };
    let retry_copy = if session.retry_buffer_truncated() {
        0
    } else {
        bytes - buffered_from.unwrap_or(bytes)
    };
    // A slice keeps the whole buffer alive.
    let kept = if unreplayed > 0 { bytes } else { 0 };
    held.shrink_to(retry_copy + kept);
    let unreplayed = (unreplayed > 0).then(|| buf.freeze().slice(..unreplayed));
    Ok(Ok(Peeked {
        key,
        model,
        previous,
        bytes,
        unreplayed,
        held,
    }))
}

/// Whether the client waits for `100 Continue` before it sends the body.
pub fn expects_continue(session: &Session) -> bool {
    session
        .req_header()
        .headers
        .get(EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// The body length the client declared, if it declared one. `Content-Length: 42, 42` (or the
/// header twice) declares 42, as Pingora reads it too (RFC 9110 §8.6); values that differ
/// declare nothing.
pub fn declared_length(headers: &HeaderMap) -> Option<usize> {
    let mut lengths = headers
        .get_all(CONTENT_LENGTH)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("x").split(','))
        .map(|n| digits(n.trim()));
    let first = lengths.next()??;
    lengths.all(|n| n == Some(first)).then_some(first)
}

/// A length as HTTP writes one: digits only (`parse` would also take `+5`, which Pingora does
/// not).
fn digits(n: &str) -> Option<usize> {
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    n.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lengths(values: &[&str]) -> Option<usize> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(CONTENT_LENGTH, v.parse().unwrap());
        }
        declared_length(&h)
    }

    #[test]
    fn a_length_is_declared_once_or_repeated_identically() {
        assert_eq!(lengths(&["42"]), Some(42));
        assert_eq!(lengths(&["42, 42"]), Some(42));
        assert_eq!(lengths(&["42", " 42 "]), Some(42));
        assert_eq!(lengths(&[]), None);
        assert_eq!(lengths(&["42", "43"]), None);
        assert_eq!(lengths(&["42,"]), None);
        assert_eq!(lengths(&["+42"]), None, "not a length as HTTP writes one");
        assert_eq!(lengths(&["99999999999999999999999"]), None);
    }
}
