//! Mock upstreams as a test holds them: where each listens, what it saw, the knobs of its
//! health and load, and starting them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};

use super::mock::serve_mock;
use super::Seen;

pub struct Upstream {
    pub addr: SocketAddr,
    pub name: String,
    pub(super) seen: Arc<Mutex<Vec<Seen>>>,
    /// Requests being answered right now.
    pub active: Arc<AtomicUsize>,
    /// The most requests (health checks included) ever answered at once.
    pub peak: Arc<AtomicUsize>,
    /// What `/health` answers: 200 while true, 503 while false.
    pub healthy: Arc<AtomicBool>,
    pub health_checks: Arc<AtomicUsize>,
    /// What its `/metrics` says waits in its queue, as vLLM says it.
    pub engine_waiting: Arc<AtomicUsize>,
    /// What its `GET /v1/models` lists; while empty, it answers that as any other request.
    pub models: Arc<Mutex<Vec<String>>>,
    pub(super) task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    /// Requests other than health checks.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
    pub fn addr_str(&self) -> String {
        self.addr.to_string()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A mock OpenAI-compatible server. Request headers steer it:
/// `x-mock-status: N` answers N; `x-mock-delay-ms: D` waits D ms before answering;
/// `x-mock-events: N` with `x-mock-interval-ms: M` streams N SSE events M ms apart, and
/// `x-mock-reset-after: K` drops the connection after K of them, `x-mock-event-bytes: B` pads
/// each event to about B bytes; otherwise it answers JSON
/// naming itself and the body it got.
pub async fn start_upstream(name: &str) -> Upstream {
    start_upstream_on(
        name,
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .await
}

pub async fn start_upstream_on(name: &str, listener: tokio::net::TcpListener) -> Upstream {
    let addr = listener.local_addr().unwrap();
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    serve_mock(name, addr, listener)
}

/// Mock upstreams named "a", "b", "c", ...
pub async fn upstreams<const N: usize>() -> [Upstream; N] {
    let mut ups = Vec::with_capacity(N);
    for i in 0..N {
        ups.push(start_upstream(&((b'a' + i as u8) as char).to_string()).await);
    }
    ups.try_into()
        .unwrap_or_else(|_| unreachable!("N upstreams were started"))
}
