//! Plain HTTP/1 connections that cost only their socket while they wait for a request.
//!
//! Pingora builds a connection's next request (its proxy future, about 17 KB, and a 4 KiB head
//! buffer) as soon as the previous one ends, and keeps them for as long as the client stays
//! silent: most of what an idle keep-alive connection holds (`cargo bench --bench memory`).
//! Here the connection's own loop waits for the request with nothing but the socket, and only
//! then reads what has come and hands Pingora a session, those bytes as the start of its head.
//! They are read through the connection's stream, so over TLS they are what rustls decrypts (a
//! request it already holds, the socket no longer shows, is read at once).
//! The loop also reads the rest of the head, when the first read did not end it, within the
//! head timeout (`proxy.client_header_timeout_ms`): Pingora's own reads time out one by one
//! (60 s each), so a client that sent its head a byte at a time held the connection for ever.
//! HTTP/2 connections (h2c, or TLS with `h2` agreed) take Pingora's own loop: one such
//! connection is one session for all its streams. With h2c, a plain connection's first bytes
//! are read here too, within the same limits, and handed back to the socket when they are
//! HTTP/2's preface: Pingora's own look for it waits for 24 bytes with no limit, which held
//! a short HTTP/1.0 request, or a silent client, for ever.

use std::fmt::{self, Write as _};
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{BufMut, BytesMut};
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ServerApp};
use pingora::protocols::http::ServerSession;
use pingora::protocols::l4::stream::Stream as PlainStream;
use pingora::protocols::{Stream, ALPN};
use pingora::server::ShutdownWatch;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};

use super::error::ApiError;
use crate::metrics;
use head::{Head, HeadScan, HEAD_LIMIT};

mod head;

/// Pingora's own limits, kept: a new connection's first request must begin within its read
/// timeout, a reused one's within its keep-alive timeout; both are 60 s. An HTTP/2
/// connection without a stream is closed after as long.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_secs(60);
/// What an HTTP/2 client sends first without ALPN (RFC 9113, 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The head buffer Pingora would have started with (`INIT_HEADER_BUF_SIZE`).
const HEAD_BUFFER: usize = 4096;
/// How long a client that let its head time out has to take its 408.
const LINGER: Duration = Duration::from_secs(1);

pub struct IdleConnections<A> {
    app: Arc<A>,
    h2c: bool,
    head_timeout: Duration,
}

impl<A> IdleConnections<A> {
    pub fn new(app: A, h2c: bool, head_timeout: Duration) -> Self {
        Self {
            app: Arc::new(app),
            h2c,
            head_timeout,
        }
    }
}

#[async_trait]
impl<A> ServerApp for IdleConnections<A>
where
    A: HttpServerApp + Send + Sync + 'static,
{
    async fn process_new(
        self: &Arc<Self>,
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        // Without ALPN or with `http/1.1` agreed, Pingora too takes the connection as HTTP/1.
        if !matches!(stream.selected_alpn_proto(), None | Some(ALPN::H1)) {
            return ServerApp::process_new(&self.app, stream, shutdown).await;
        }
        // h2c is for plain connections, and shows in a connection's first bytes only.
        let mut h2c = self.h2c && stream.get_ssl_digest().is_none();
        let mut carried: Option<HttpPersistentSettings> = None;
        loop {
            // Bytes the last request's read took past its end are this one's start: the client
            // may send nothing more until they are answered.
            let first = if carried.as_ref().is_some_and(holds_pipelined_bytes) {
                None
            } else {
                let mut first = first_bytes(&mut stream).await?;
                let mut deadline = None;
                if std::mem::take(&mut h2c) {
                    (first, deadline) = self.preface(&mut stream, first).await?;
                    if first.starts_with(H2_PREFACE) {
                        // Given back to the socket, for Pingora's own look and its HTTP/2.
                        let Ok(mut plain) = stream.into_any().downcast::<PlainStream>() else {
                            log::warn!("h2c: a plain connection's stream is of another kind");
                            return None;
                        };
                        plain.rewind(&first);
                        return ServerApp::process_new(&self.app, plain, shutdown).await;
                    }
                }
                Some(self.rest_of_head(&mut stream, first, deadline).await?)
            };
            let mut session = ServerSession::new_http1(stream);
            match carried {
                Some(settings) => settings.apply_to_session(&mut session),
                // As Pingora starts a connection: no reuse once the drain has begun.
                None => {
                    let keepalive = (!*shutdown.borrow()).then_some(IDLE_LIMIT.as_secs());
                    session.set_keepalive(keepalive);
                    session.set_keepalive_reuses_remaining(
                        self.app
                            .server_options()
                            .and_then(|o| o.keepalive_request_limit),
                    );
                }
            }
            if let Some(head) = first {
                session.set_pipelined_prefix(head);
            }
            let reused = self.app.process_new_http(session, shutdown).await?;
            (stream, carried) = reused.consume();
        }
    }

    async fn cleanup(&self) {
        self.app.http_cleanup().await;
    }
}

impl<A> IdleConnections<A> {
    /// `read` and what follows it while that is the start of HTTP/2's preface and shorter,
    /// with the head timeout's deadline when it had to wait for more: an HTTP/1 head goes on
    /// under the same one. `None` when the client closes, or lets the timeout pass (then told
    /// so with a 408). An HTTP/1 request parts from the preface at its first or second byte.
    async fn preface(
        &self,
        stream: &mut Stream,
        mut read: BytesMut,
    ) -> Option<(BytesMut, Option<tokio::time::Instant>)> {
        let mut deadline = None;
        while read.len() < H2_PREFACE.len() && H2_PREFACE.starts_with(&read) {
            let until =
                *deadline.get_or_insert_with(|| tokio::time::Instant::now() + self.head_timeout);
            self.read_more(stream, &mut read, HEAD_BUFFER, until, true)
                .await?;
        }
        Some((read, deadline))
    }

    /// `head` and what follows it up to the end of the request's head (most heads end within
    /// the first read, and take no more), read within the head timeout from the request line's
    /// first byte (or by `deadline`, when the look for HTTP/2's preface set one); `None` when
    /// the client closes, stays silent or lets the timeout pass, which it is told with a 408.
    async fn rest_of_head(
        &self,
        stream: &mut Stream,
        mut head: BytesMut,
        mut deadline: Option<tokio::time::Instant>,
    ) -> Option<BytesMut> {
        let mut scan = HeadScan::default();
        // Empty lines alone, sent now and then, must not keep the connection for ever either.
        let idle = tokio::time::Instant::now() + IDLE_LIMIT;
        loop {
            match scan.look(&head) {
                Head::Ends | Head::PastPingorasLimits => return Some(head),
                // Empty lines before a request line are not yet a request: the connection is
                // still idle.
                Head::Blank => {}
                Head::Partial => {
                    deadline.get_or_insert_with(|| tokio::time::Instant::now() + self.head_timeout);
                }
            }
            let room = (HEAD_LIMIT - head.len()).min(HEAD_BUFFER);
            // Silent past the idle limit before any head began: closed without a word.
            let until = deadline.unwrap_or(idle);
            self.read_more(stream, &mut head, room, until, deadline.is_some())
                .await?;
        }
    }

    /// One more read of a head into `head` (at most `room` bytes) by `until`; `None` when the
    /// client closes or lets `until` pass, which, with `refuse`, it is told with a 408.
    async fn read_more(
        &self,
        stream: &mut Stream,
        head: &mut BytesMut,
        room: usize,
        until: tokio::time::Instant,
        refuse: bool,
    ) -> Option<()> {
        head.reserve(room);
        // Into the head's own buffer: a buffer on the stack would be in the connection's
        // future, idle or not.
        let mut limited = head.limit(room);
        match tokio::time::timeout_at(until, stream.read_buf(&mut limited)).await {
            Ok(Ok(n)) if n > 0 => Some(()),
            Ok(_) => None,
            Err(_) => {
                if refuse {
                    self.refuse_slow_head(stream).await;
                }
                None
            }
        }
    }

    /// Answers 408 and closes, reading what the client still sends meanwhile: closing a socket
    /// with unread bytes resets the connection, which can take the answer with it.
    async fn refuse_slow_head(&self, stream: &mut Stream) {
        metrics::REJECTIONS
            .with_label_values(&["header_timeout"])
            .inc();
        let body = ApiError::request_timeout("head", self.head_timeout).body();
        let mut answer = format!(
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        answer.extend_from_slice(&body);
        let _ = tokio::time::timeout(LINGER, async {
            stream.write_all(&answer).await?;
            stream.shutdown().await?;
            let mut sink = vec![0u8; HEAD_BUFFER];
            while stream.read(&mut sink).await? > 0 {}
            std::io::Result::Ok(())
        })
        .await;
    }
}

/// The start of the next request, as much as one read gets (up to a head buffer's worth) once
/// the client sends it; `None` when it closes or stays silent past the limit. The buffer is
/// made at each poll and kept only when the read put bytes in it, so a silent connection holds
/// none, and a request takes no more reads than in Pingora's own loop, which would read its
/// head into such a buffer.
async fn first_bytes(stream: &mut Stream) -> Option<BytesMut> {
    let read = std::future::poll_fn(|cx| {
        let mut head = BytesMut::zeroed(HEAD_BUFFER);
        let mut buf = ReadBuf::new(&mut head);
        match Pin::new(&mut *stream).poll_read(cx, &mut buf) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len();
                head.truncate(n);
                Poll::Ready((n > 0).then_some(head))
            }
            Poll::Ready(Err(_)) => Poll::Ready(None),
        }
    });
    tokio::time::timeout(IDLE_LIMIT, read).await.ok().flatten()
}

/// Whether Pingora carries bytes of the next request over to it. Its settings do not say so
/// but in their `Debug` form, which this reads up to that field and no further;
/// a test below and `tests/proxy/http1.rs`'s pipelining test fail if that form changes.
fn holds_pipelined_bytes(settings: &HttpPersistentSettings) -> bool {
    let mut probe = FieldProbe::default();
    // The probe stops the formatting once it knows.
    let _ = write!(probe, "{settings:?}");
    probe.found == Some(true)
}

#[derive(Default)]
struct FieldProbe {
    at_field: bool,
    found: Option<bool>,
}

impl fmt::Write for FieldProbe {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if self.at_field {
            if s.trim_start_matches([':', ' ']).is_empty() {
                return Ok(());
            }
            self.found = Some(s.starts_with("Some"));
            return Err(fmt::Error);
        }
        self.at_field = s == "pipelined_prefix";
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pingora::protocols::l4::stream::Stream as L4Stream;

    /// Pingora's own settings, as its proxy hands them over, with and without such bytes.
    #[tokio::test]
    async fn sees_the_bytes_pingora_carries_over() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut session = ServerSession::new_http1(Box::new(L4Stream::from(tcp)));
        session.set_keepalive(Some(60));
        let mut settings = HttpPersistentSettings::for_session(&session);
        settings.set_user_context(Box::new(1u8));
        assert!(!holds_pipelined_bytes(&settings));
        settings.set_pipelined_prefix(BytesMut::from(&b"POST / HTTP/1.1"[..]));
        assert!(holds_pipelined_bytes(&settings));
    }
}
