//! Test support, for the tests and the benchmarks alike (benches include this file): mock
//! inference servers (a GPU server is the one peer we do not own) and the real `prefixlb`
//! binary on ephemeral loopback ports, configured through the typed builders of `config`.

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener as StdListener};
use std::time::{Duration, Instant};

mod config;
pub mod dns;
mod mock;
mod proxy;
mod tls;
mod upstream;

// Each test binary and bench uses some of these, none all of them.
#[allow(unused_imports)]
pub use {config::*, mock::*, proxy::*, tls::*, upstream::*};

pub fn free_addr() -> SocketAddr {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// An address that refuses connections for as long as the socket returned is kept: bound, not
/// listening, and without `SO_REUSEADDR`, so no other test's listener can take the port (a port
/// only looked up free may be bound by a parallel test before it is dialled).
pub fn refused_addr() -> (SocketAddr, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    (socket.local_addr().unwrap(), socket)
}

pub fn free_port() -> u16 {
    free_addr().port()
}

/// The value of a sample in Prometheus text, named as written there (labels included); 0 when
/// absent.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits (at most 20 s) until something accepts connections on `addr`.
pub async fn wait_listening(addr: SocketAddr, what: &str) {
    let start = Instant::now();
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what} did not start on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A chat request body: a shared system prompt, the conversation's first question, and
/// `turns - 1` further exchanges.
pub fn chat(system: &str, first: &str, turns: usize, stream: bool) -> String {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": system}),
        serde_json::json!({"role": "user", "content": first}),
    ];
    for t in 1..turns {
        messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
        messages.push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
    }
    serde_json::json!({"model": "m", "stream": stream, "messages": messages}).to_string()
}

/// Opens a chat stream through `proxy` of `events` SSE events `interval_ms` apart (the mock
/// upstream makes them); returns once the response head is in.
pub async fn open_stream(proxy: &Proxy, events: u32, interval_ms: u32) -> reqwest::Response {
    open_stream_at(&proxy.url("/v1/chat/completions"), events, interval_ms).await
}

/// [`open_stream`] to a chat URL of a process the tests did not start through [`Proxy`].
pub async fn open_stream_at(url: &str, events: u32, interval_ms: u32) -> reqwest::Response {
    client()
        .post(url)
        .header("x-mock-events", events.to_string())
        .header("x-mock-interval-ms", interval_ms.to_string())
        .body(chat("s", "q", 1, true))
        .send()
        .await
        .unwrap()
}

/// Reads a response's body to its end: what came, and whether the body ended whole (the
/// transport's error when it did not).
pub async fn read_body(mut r: reqwest::Response) -> (String, Result<(), String>) {
    let mut body = String::new();
    loop {
        match r.chunk().await {
            Ok(Some(c)) => body.push_str(&String::from_utf8_lossy(&c)),
            Ok(None) => return (body, Ok(())),
            Err(e) => return (body, Err(format!("{e:?}"))),
        }
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().build().unwrap()
}
