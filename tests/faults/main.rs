//! Engines that misbehave, through the real binary: one that takes requests and sends nothing
//! (wedged), one whose stream stalls half-way, one killed in the middle of a stream, one that
//! answers what is not HTTP, one that sends a byte at a time. The engines are mocks written
//! on raw sockets (an engine is a peer we do not own), so that each can break HTTP exactly as
//! a failing server does.

#[path = "../common/mod.rs"]
mod common;

mod broken_streams;
mod vanishing_peers;
mod wedged;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// What a mock engine does with one `POST`, given the connection after the request was read.
pub(crate) type Answer = Arc<dyn Fn(TcpStream) -> tokio::task::JoinHandle<()> + Send + Sync>;

pub(crate) struct Engine {
    pub(crate) addr: SocketAddr,
    /// `POST`s it took.
    pub(crate) posts: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a mock engine's `GET /metrics` answers, made at each read.
pub(crate) type Page = Arc<dyn Fn() -> String + Send + Sync>;

/// An engine that answers `GET`s (health checks) with 200 and hands each `POST` to `answer`.
pub(crate) async fn engine(answer: Answer) -> Engine {
    engine_with_metrics(answer, Arc::new(|| "ok".to_owned())).await
}

/// The same, whose `GET`s answer `page` (a health check reads only the status).
pub(crate) async fn engine_with_metrics(answer: Answer, page: Page) -> Engine {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let posts = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&posts);
    let task = tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                return;
            };
            let (answer, posts, page) =
                (Arc::clone(&answer), Arc::clone(&counted), Arc::clone(&page));
            tokio::spawn(async move { serve(conn, answer, posts, page).await });
        }
    });
    Engine { addr, posts, task }
}

/// Reads requests off one connection: `GET`s answered at once, kept alive; a `POST` (body
/// read by its length) handed over with the connection.
async fn serve(conn: TcpStream, answer: Answer, posts: Arc<AtomicUsize>, page: Page) {
    let mut reader = BufReader::new(conn);
    loop {
        let mut head = Vec::new();
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            if line == "\r\n" {
                break;
            }
            head.push(line);
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).await.is_err() {
            return;
        }
        if head.first().is_some_and(|l| l.starts_with("POST")) {
            posts.fetch_add(1, Ordering::SeqCst);
            answer(reader.into_inner());
            return;
        }
        let body = page();
        let ok = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        if reader.get_mut().write_all(ok.as_bytes()).await.is_err() {
            return;
        }
    }
}

pub(crate) const SSE_HEAD: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

pub(crate) fn chunk(data: &str) -> Vec<u8> {
    format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()
}

pub(crate) fn event(text: &str) -> String {
    format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n")
}

/// A whole stream of `events` events then `[DONE]`, each `gap` apart, after `first` (the
/// prefill).
pub(crate) async fn stream(mut conn: TcpStream, events: usize, first: Duration, gap: Duration) {
    let _ = conn.write_all(SSE_HEAD.as_bytes()).await;
    tokio::time::sleep(first).await;
    for i in 0..events {
        let _ = conn.write_all(&chunk(&event(&format!("t{i}")))).await;
        tokio::time::sleep(gap).await;
    }
    let _ = conn.write_all(&chunk("data: [DONE]\n\n")).await;
    let _ = conn.write_all(b"0\r\n\r\n").await;
}

/// Reads a whole streamed answer through the proxy: its body and whether it ended whole.
pub(crate) async fn read_stream(proxy: &Proxy, conversation: &str) -> (String, Result<(), String>) {
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .body(chat(conversation, "q", 1, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    read_body(r).await
}

pub(crate) fn peer_entry(listing: &serde_json::Value, addr: SocketAddr) -> serde_json::Value {
    listing["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["address"] == addr.to_string())
        .cloned()
        .unwrap_or_else(|| panic!("{addr} not listed: {listing}"))
}
