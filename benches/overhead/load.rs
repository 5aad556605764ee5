//! The load generator: closed loops of keep-alive connections (HTTP/1.1 in the clear or over
//! TLS, or HTTP/2 streams over TLS), each sending its next request as soon as the last answer is
//! read, timing every request.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{CONNECTIONS, H2_CONNECTIONS};
use crate::common::tls::{open, Io};
use crate::common::*;

/// How the load reaches a target.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Plain,
    TlsH1,
    TlsH2,
}

/// What one closed loop sends, and how.
pub struct Load {
    pub transport: Transport,
    /// Whole HTTP/1.1 requests, head and body.
    pub requests: Vec<Vec<u8>>,
    pub ca_pem: String,
}

pub struct Run {
    pub requests: usize,
    pub elapsed: Duration,
    /// Microseconds, sorted.
    pub latencies: Vec<f64>,
    pub errors: usize,
    pub first_error: Option<String>,
    /// CPU time the proxy process used during the run.
    pub cpu: Option<Duration>,
}

impl Run {
    pub fn rps(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
}

/// 64 distinct chat requests of about `size` bytes each (distinct conversations: distinct keys).
pub fn chat_requests(size: usize) -> Vec<Vec<u8>> {
    (0..64)
        .map(|i| {
            let filler = "The patient reports mild symptoms. ".repeat(size / 36);
            let body = format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"You are terse. {filler}"}},{{"role":"user","content":"Conversation {i}: say ok."}}]}}"#
            );
            let mut request = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            request.extend_from_slice(body.as_bytes());
            request
        })
        .collect()
}

/// `CONNECTIONS` requests in flight on keep-alive connections, each sending its next request
/// as soon as the last answer is read, for `length`.
pub async fn closed_loop(target: SocketAddr, load: &Load, length: Duration) -> Run {
    let start = Instant::now();
    let deadline = start + length;
    let requests = std::sync::Arc::new(load.requests.clone());
    let tls = (load.transport != Transport::Plain).then(|| tls_connector(&load.ca_pem, &[]));
    let tasks: Vec<_> = match load.transport {
        Transport::Plain | Transport::TlsH1 => (0..CONNECTIONS)
            .map(|c| {
                tokio::spawn(connection(
                    target,
                    tls.clone(),
                    requests.clone(),
                    c,
                    deadline,
                ))
            })
            .collect(),
        Transport::TlsH2 => {
            let h2 = tls_connector(&load.ca_pem, &[b"h2"]);
            (0..H2_CONNECTIONS)
                .map(|c| {
                    tokio::spawn(h2_connection(
                        target,
                        h2.clone(),
                        requests.clone(),
                        c,
                        deadline,
                    ))
                })
                .collect()
        }
    };
    let (mut latencies, mut errors, mut first_error) = (Vec::new(), 0, None);
    for t in tasks {
        let (l, e, first) = t.await.expect("a connection task");
        latencies.extend(l);
        errors += e;
        first_error = first_error.or(first);
    }
    latencies.sort_by(f64::total_cmp);
    Run {
        requests: latencies.len(),
        elapsed: start.elapsed(),
        latencies,
        errors,
        first_error,
        cpu: None,
    }
}

type Outcome = (Vec<f64>, usize, Option<String>);

async fn connection(
    target: SocketAddr,
    tls: Option<tokio_rustls::TlsConnector>,
    requests: std::sync::Arc<Vec<Vec<u8>>>,
    first: usize,
    deadline: Instant,
) -> Outcome {
    let (mut latencies, mut errors, mut first_error) = (Vec::new(), 0usize, None);
    let mut next = first;
    let mut stream: Option<Box<dyn Io>> = None;
    let mut buf = BytesMut::with_capacity(64 * 1024);
    while Instant::now() < deadline {
        let s = match stream.as_mut() {
            Some(s) => s,
            None => match open(target, tls.as_ref()).await {
                Ok(s) => {
                    buf.clear();
                    stream.insert(s)
                }
                Err(e) => {
                    errors += 1;
                    first_error.get_or_insert(e);
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let request = &requests[next % requests.len()];
        next += CONNECTIONS;
        let sent = Instant::now();
        match exchange(s, request, &mut buf).await {
            Ok(()) => latencies.push(sent.elapsed().as_secs_f64() * 1e6),
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(e);
                stream = None;
            }
        }
    }
    (latencies, errors, first_error)
}

/// One HTTP/2 connection, reused throughout, with `CONNECTIONS / H2_CONNECTIONS` streams in
/// flight on it at all times.
async fn h2_connection(
    target: SocketAddr,
    tls: tokio_rustls::TlsConnector,
    requests: std::sync::Arc<Vec<Vec<u8>>>,
    first: usize,
    deadline: Instant,
) -> Outcome {
    let opened = match open(target, Some(&tls)).await {
        Ok(io) => hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(io),
        )
        .await
        .map_err(|e| format!("h2 handshake: {e}")),
        Err(e) => Err(e),
    };
    let send = match opened {
        Ok((send, conn)) => {
            tokio::spawn(conn);
            send
        }
        Err(e) => return (Vec::new(), 1, Some(e)),
    };
    let per_connection = CONNECTIONS / H2_CONNECTIONS;
    let streams: Vec<_> = (0..per_connection)
        .map(|k| {
            let (mut send, requests) = (send.clone(), requests.clone());
            tokio::spawn(async move {
                let (mut latencies, mut errors, mut first_error) = (Vec::new(), 0usize, None);
                let mut next = first * per_connection + k;
                while Instant::now() < deadline {
                    let raw = &requests[next % requests.len()];
                    next += CONNECTIONS;
                    let sent = Instant::now();
                    match h2_exchange(&mut send, raw).await {
                        Ok(()) => latencies.push(sent.elapsed().as_secs_f64() * 1e6),
                        Err(e) => {
                            errors += 1;
                            first_error.get_or_insert(e);
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
                (latencies, errors, first_error)
            })
        })
        .collect();
    let mut out: Outcome = (Vec::new(), 0, None);
    for s in streams {
        let (l, e, first) = s.await.expect("a stream task");
        out.0.extend(l);
        out.1 += e;
        out.2 = out.2.or(first);
    }
    out
}

/// The HTTP/1.1 request `raw` as an HTTP/2 one, and its whole answer, which must be a 200.
async fn h2_exchange(
    send: &mut hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>,
    raw: &[u8],
) -> Result<(), String> {
    use http_body_util::BodyExt;
    let at = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("a request without a head")?;
    let body = bytes::Bytes::copy_from_slice(&raw[at + 4..]);
    let request = hyper::Request::post("https://localhost/v1/chat/completions")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(body))
        .map_err(|e| e.to_string())?;
    send.ready().await.map_err(|e| format!("h2: {e}"))?;
    let answer = send
        .send_request(request)
        .await
        .map_err(|e| format!("h2: {e}"))?;
    if answer.status() != 200 {
        return Err(format!("status {}", answer.status()));
    }
    answer
        .into_body()
        .collect()
        .await
        .map(drop)
        .map_err(|e| format!("h2 body: {e}"))
}

/// One request and its whole answer, which must be a 200 with a length.
async fn exchange(s: &mut Box<dyn Io>, request: &[u8], buf: &mut BytesMut) -> Result<(), String> {
    s.write_all(request)
        .await
        .map_err(|e| format!("write: {e}"))?;
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut response = httparse::Response::new(&mut headers);
        match response.parse(buf) {
            Ok(httparse::Status::Complete(head)) => {
                if response.code != Some(200) {
                    return Err(format!("status {:?}", response.code));
                }
                let length = response
                    .headers
                    .iter()
                    .find(|h| h.name.eq_ignore_ascii_case("content-length"))
                    .and_then(|h| {
                        std::str::from_utf8(h.value)
                            .ok()?
                            .trim()
                            .parse::<usize>()
                            .ok()
                    })
                    .ok_or("an answer without Content-Length")?;
                while buf.len() < head + length {
                    read_more(s, buf).await?;
                }
                let _ = buf.split_to(head + length);
                return Ok(());
            }
            Ok(httparse::Status::Partial) => read_more(s, buf).await?,
            Err(e) => return Err(format!("unreadable answer: {e}")),
        }
    }
}

async fn read_more(s: &mut Box<dyn Io>, buf: &mut BytesMut) -> Result<(), String> {
    buf.reserve(16 * 1024);
    match s.read_buf(buf).await {
        Ok(0) => Err("closed".into()),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("read: {e}")),
    }
}
