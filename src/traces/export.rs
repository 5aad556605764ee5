//! The exporter's HTTP client: Pingora's connector, the one the engines are reached with
//! (rustls with ring, the system's roots), so that no second HTTP and TLS stack comes in.
//!
//! The SDK's batch processor calls the exporter from a thread of its own, outside any runtime;
//! the connector needs tokio's. So the client keeps a runtime of one thread, started with it,
//! and each export runs there while the processor's thread waits for it. Pingora's runtimes
//! are not used: they stop before the last spans are sent at shutdown.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use http::{Request, Response};
use opentelemetry_http::{HttpClient, HttpError};
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::upstreams::peer::HttpPeer;

/// The most of a collector's answer read: it only counts the spans it rejected.
const MAX_ANSWER: usize = 64 * 1024;

/// How long a connection to the collector is kept between exports (a batch leaves every few
/// seconds while requests come).
const KEEP_IDLE: Duration = Duration::from_secs(30);

pub struct Client {
    /// `None` once dropped.
    runtime: Option<tokio::runtime::Runtime>,
    post: Arc<Post>,
}

struct Post {
    connector: Connector,
    timeout: Duration,
    /// The last export failed: said once in the log, and again when one succeeds.
    failing: AtomicBool,
}

impl Client {
    pub fn new(timeout: Duration) -> Result<Self, String> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("traces export")
            .enable_all()
            .build()
            .map_err(|e| format!("its runtime: {e}"))?;
        Ok(Self {
            runtime: Some(runtime),
            post: Arc::new(Post {
                connector: Connector::new(None),
                timeout,
                failing: AtomicBool::new(false),
            }),
        })
    }
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("traces::export::Client")
    }
}

#[async_trait]
impl HttpClient for Client {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let runtime = self.runtime.as_ref().ok_or("the exporter has stopped")?;
        let post = Arc::clone(&self.post);
        let timeout = post.timeout;
        let sent = runtime
            .spawn(async move {
                tokio::time::timeout(timeout, post.send(request))
                    .await
                    .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")))
            })
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r);
        let status = sent.as_ref().map(|r| r.status().as_u16());
        let ok = matches!(status, Ok(200..=299));
        let was_failing = self.post.failing.swap(!ok, Ordering::Relaxed);
        match (&status, was_failing, ok) {
            (Err(e), false, _) => log::warn!("traces: could not send spans: {e}"),
            (Ok(code), false, false) => log::warn!("traces: the collector answered {code}"),
            (_, true, true) => log::info!("traces: spans are sent again"),
            _ => {}
        }
        sent.map_err(HttpError::from)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // Dropped by the processor's thread or at exit; never blocks on a task still running.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Post {
    /// Sends `request` to its URL over HTTP/1.1 and reads the answer.
    async fn send(&self, request: Request<Bytes>) -> Result<Response<Bytes>, String> {
        let text = |e: Box<pingora::Error>| e.to_string();
        let (parts, body) = request.into_parts();
        let uri = &parts.uri;
        let tls = uri.scheme_str() == Some("https");
        let authority = uri.authority().ok_or("the URL names no host")?;
        // `[::1]` is how a URL writes the address `::1`.
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
        // Looked up at each export: a collector behind a name may move.
        let addr = tokio::net::lookup_host((host, port))
            .await
            .map_err(|e| format!("{host}: {e}"))?
            .next()
            .ok_or_else(|| format!("{host} has no address"))?;
        let mut peer = HttpPeer::new(addr, tls, host.to_owned());
        peer.options.connection_timeout = Some(self.timeout);
        peer.options.total_connection_timeout = Some(self.timeout);
        peer.options.read_timeout = Some(self.timeout);
        peer.options.write_timeout = Some(self.timeout);
        let (mut session, _) = self.connector.get_http_session(&peer).await.map_err(text)?;
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        let mut head =
            RequestHeader::build(parts.method.as_str(), path.as_bytes(), None).map_err(text)?;
        for (name, value) in &parts.headers {
            head.append_header(name.clone(), value.clone())
                .map_err(text)?;
        }
        head.insert_header(http::header::HOST, authority.as_str())
            .map_err(text)?;
        head.insert_header(http::header::CONTENT_LENGTH, body.len())
            .map_err(text)?;
        session
            .write_request_header(Box::new(head))
            .await
            .map_err(text)?;
        session.write_request_body(body, true).await.map_err(text)?;
        session.finish_request_body().await.map_err(text)?;
        session.read_response_header().await.map_err(text)?;
        let status = session.response_header().map_or(0, |h| h.status.as_u16());
        let mut answer = BytesMut::new();
        while let Some(chunk) = session.read_response_body().await.map_err(text)? {
            answer.extend_from_slice(&chunk);
            if answer.len() > MAX_ANSWER {
                return Err(format!("an answer over {MAX_ANSWER} bytes"));
            }
        }
        self.connector
            .release_http_session(session, &peer, Some(KEEP_IDLE))
            .await;
        Response::builder()
            .status(status)
            .body(answer.freeze())
            .map_err(|e| e.to_string())
    }
}
