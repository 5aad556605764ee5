//! The real proxy binary against mock inference servers on loopback.

#[path = "../common/mod.rs"]
mod common;

mod bad_input;
mod bodies;
mod expect_continue;
mod http1;
mod routing;
mod saturation;
mod streams;

use std::time::Duration;

use common::*;
use futures_util::StreamExt;

pub(crate) const CHAT: &str = "/v1/chat/completions";

pub(crate) async fn post_chat(
    c: &reqwest::Client,
    proxy: &Proxy,
    body: String,
) -> reqwest::Response {
    c.post(proxy.url(CHAT))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap()
}

pub(crate) fn upstream_of(r: &reqwest::Response) -> String {
    r.headers()["x-upstream"].to_str().unwrap().to_owned()
}

/// A chat body of exactly `len` bytes whose key needs all of it: the first user message is the
/// filler and `model` comes last, so the peek reads as far as it may.
pub(crate) fn sized_body(len: usize) -> Vec<u8> {
    if len == 0 {
        return Vec::new();
    }
    let head = br#"{"messages":[{"role":"user","content":""#;
    let tail = br#""}],"model":"m"}"#;
    let filler = len.saturating_sub(head.len() + tail.len());
    let mut body = Vec::with_capacity(len);
    body.extend_from_slice(head);
    body.extend((0..filler).map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789 "[i % 37]));
    body.extend_from_slice(tail);
    body.truncate(len);
    body
}

pub(crate) enum Framing {
    Length,
    Chunked(usize),
    Trickle { pieces: usize, gap_ms: u64 },
}

pub(crate) fn framed(body: Vec<u8>, framing: &Framing) -> reqwest::Body {
    match *framing {
        Framing::Length => reqwest::Body::from(body),
        Framing::Chunked(size) => {
            let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
                body.chunks(size).map(|c| Ok(c.to_vec())).collect();
            reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
        }
        Framing::Trickle { pieces, gap_ms } => {
            let size = body.len().div_ceil(pieces).max(1);
            let chunks: Vec<Vec<u8>> = body.chunks(size).map(<[u8]>::to_vec).collect();
            let stream = futures_util::stream::iter(chunks).then(move |c| async move {
                tokio::time::sleep(Duration::from_millis(gap_ms)).await;
                Ok::<_, std::io::Error>(c)
            });
            reqwest::Body::wrap_stream(stream)
        }
    }
}

/// What the proxy sends on `s` from now until it closes (or 5 s pass).
pub(crate) async fn read_to_close(s: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(n @ 1..) = s.read(&mut buf).await {
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    String::from_utf8_lossy(&got).into_owned()
}
