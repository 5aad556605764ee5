//! Test support, for the tests and the benchmarks alike (benches include this file): mock
//! inference servers (a GPU server is the one peer we do not own) and the real `prefixlb`
//! binary on ephemeral loopback ports, configured through the typed builders of `config`.

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use sha2::{Digest, Sha256};

mod config;
pub mod dns;

pub use config::*;

/// What a mock upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub len: usize,
    pub sha256: String,
    pub chunked: bool,
    pub content_length: Option<usize>,
    pub headers: HeaderMap,
}

#[derive(Clone)]
struct MockState {
    name: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    active: Arc<AtomicUsize>,
    peak: Arc<AtomicUsize>,
    healthy: Arc<AtomicBool>,
    health_checks: Arc<AtomicUsize>,
    engine_waiting: Arc<AtomicUsize>,
    models: Arc<Mutex<Vec<String>>>,
}

pub struct Upstream {
    pub addr: SocketAddr,
    pub name: String,
    seen: Arc<Mutex<Vec<Seen>>>,
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
    task: tokio::task::JoinHandle<()>,
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

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `got`, what came back on one connection, holds a 200 for each of `bodies` and the mock's
/// digest of each in the order they were sent.
pub fn assert_answered_in_order(got: &str, bodies: &[String]) {
    assert_eq!(got.matches("HTTP/1.1 200").count(), bodies.len(), "{got}");
    let at: Vec<usize> = bodies
        .iter()
        .map(|b| {
            got.find(&sha256_hex(b.as_bytes()))
                .expect("an answer per request")
        })
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "out of order: {got}");
}

/// A certificate authority of the test's own.
pub struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Self {
            ca: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    pub fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A certificate for `localhost` and 127.0.0.1, and its key (PEM).
    pub fn leaf(&self) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// Writes `text` to `path` the way a certificate manager does: whole, by a rename.
pub fn put(path: &std::path::Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A TLS client that trusts `ca_pem` alone and offers `alpn`.
pub fn tls_connector(ca_pem: &str, alpn: &[&[u8]]) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(Arc::new(config))
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

/// [`start_upstream`] behind TLS, with the certificate chain and key given (PEM).
pub async fn start_tls_upstream(name: &str, cert_pem: &str, key_pem: &str) -> Upstream {
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let chain = rustls::pki_types::CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    serve_mock(name, addr, TlsListener { tcp, acceptor })
}

/// Accepts TLS connections; a handshake that fails is dropped and the next one accepted.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, from)) = self.tcp.accept().await else {
                continue;
            };
            let _ = tcp.set_nodelay(true);
            if let Ok(Ok(tls)) =
                tokio::time::timeout(Duration::from_secs(5), self.acceptor.accept(tcp)).await
            {
                return (tls, from);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

fn serve_mock<L>(name: &str, addr: SocketAddr, listener: L) -> Upstream
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    let state = MockState {
        name: name.to_owned(),
        seen: Arc::default(),
        active: Arc::default(),
        peak: Arc::default(),
        healthy: Arc::new(AtomicBool::new(true)),
        health_checks: Arc::default(),
        engine_waiting: Arc::default(),
        models: Arc::default(),
    };
    let engine_waiting = Arc::clone(&state.engine_waiting);
    let models = Arc::clone(&state.models);
    let (seen, active, peak) = (
        Arc::clone(&state.seen),
        Arc::clone(&state.active),
        Arc::clone(&state.peak),
    );
    let (healthy, health_checks) = (Arc::clone(&state.healthy), Arc::clone(&state.health_checks));
    let app = axum::Router::new().fallback(mock).with_state(state);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Upstream {
        addr,
        name: name.to_owned(),
        seen,
        active,
        peak,
        healthy,
        health_checks,
        engine_waiting,
        models,
        task,
    }
}

fn header_num(h: &HeaderMap, name: &str) -> Option<u64> {
    h.get(name)?.to_str().ok()?.parse().ok()
}

struct Active(Arc<AtomicUsize>);
impl Drop for Active {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn mock(State(s): State<MockState>, req: Request) -> Response {
    // Its metrics, as an engine reports them: not a request it answers, so not counted.
    if req.uri().path() == "/metrics" {
        let page = format!(
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\"}} {}\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"m\"}} {}\n",
            s.active.load(Ordering::SeqCst),
            s.engine_waiting.load(Ordering::SeqCst)
        );
        return reply(&s.name, StatusCode::OK, page);
    }
    let models = s.models.lock().unwrap().clone();
    if req.uri().path() == "/v1/models" && !models.is_empty() {
        let data: Vec<_> = models
            .iter()
            .map(|id| serde_json::json!({"id": id, "object": "model"}))
            .collect();
        let list = serde_json::json!({"object": "list", "data": data});
        return reply(&s.name, StatusCode::OK, list.to_string());
    }
    let now = s.active.fetch_add(1, Ordering::SeqCst) + 1;
    s.peak.fetch_max(now, Ordering::SeqCst);
    let active = Active(Arc::clone(&s.active));
    let (parts, body) = req.into_parts();
    let h = parts.headers;
    let chunked = h
        .get("transfer-encoding")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"));
    let content_length = header_num(&h, "content-length").map(|n| n as usize);
    let bytes = match axum::body::to_bytes(body, usize::MAX).await {
        Ok(b) => b,
        Err(_) => return reply(&s.name, StatusCode::BAD_REQUEST, "{}".into()),
    };
    if parts.uri.path() == "/health" {
        s.health_checks.fetch_add(1, Ordering::SeqCst);
        let status = if s.healthy.load(Ordering::SeqCst) {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        return reply(&s.name, status, "{}".into());
    }
    s.seen.lock().unwrap().push(Seen {
        path: parts.uri.path().to_owned(),
        len: bytes.len(),
        sha256: sha256_hex(&bytes),
        chunked,
        content_length,
        headers: h.clone(),
    });
    if let Some(ms) = header_num(&h, "x-mock-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(status) = header_num(&h, "x-mock-status") {
        let status = StatusCode::from_u16(status as u16).unwrap();
        return reply(&s.name, status, r#"{"error":{"message":"mock"}}"#.into());
    }
    if parts.uri.path() == "/v1/responses" {
        return responses_api(&s, &bytes);
    }
    if let Some(events) = header_num(&h, "x-mock-events") {
        let interval = Duration::from_millis(header_num(&h, "x-mock-interval-ms").unwrap_or(10));
        let reset_after = header_num(&h, "x-mock-reset-after");
        let pad = "x".repeat(header_num(&h, "x-mock-event-bytes").unwrap_or(0) as usize);
        let stream = futures_util::stream::unfold(0u64, move |i| {
            let pad = pad.clone();
            async move {
                if i > events {
                    return None;
                }
                if i > 0 {
                    tokio::time::sleep(interval).await;
                }
                if reset_after == Some(i) {
                    // An error mid-body makes the server drop the connection: an upstream reset.
                    return Some((Err(std::io::Error::other("mock reset")), events + 1));
                }
                let line = if i == events {
                    "data: [DONE]\n\n".to_owned()
                } else {
                    format!("data: {{\"i\":{i},\"pad\":\"{pad}\"}}\n\n")
                };
                Some((Ok::<_, std::io::Error>(line), i + 1))
            }
        });
        // The guard lives as long as the stream: the request is active until it ends.
        let stream = futures_util::StreamExt::map(stream, move |item| {
            let _keep = &active;
            item
        });
        return Response::builder()
            .status(200)
            .header("content-type", "text/event-stream")
            .header("x-upstream", &s.name)
            .body(Body::from_stream(stream))
            .unwrap();
    }
    let mut body =
        serde_json::json!({"upstream": s.name, "len": bytes.len(), "sha256": sha256_hex(&bytes)});
    // The usage an engine reports, with as many prompt tokens found cached as the header says.
    if let Some(cached) = header_num(&h, "x-mock-cached-tokens") {
        body["usage"] = serde_json::json!({"prompt_tokens": 100, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": cached}});
    }
    reply(&s.name, StatusCode::OK, body.to_string())
}

/// The Responses API as vLLM serves it: each response has an id this mock alone knows (its
/// name and a count), and a request continuing a response it does not hold gets a 404.
fn responses_api(s: &MockState, body: &[u8]) -> Response {
    let req: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let mine = format!("resp_{}_", s.name);
    if let Some(previous) = req["previous_response_id"].as_str() {
        if !previous.starts_with(&mine) {
            let error = serde_json::json!({"error": {"message": format!("Response with id '{previous}' not found."), "type": "invalid_request_error", "code": 404}});
            return reply(&s.name, StatusCode::NOT_FOUND, error.to_string());
        }
    }
    let id = format!("{mine}{}", s.seen.lock().unwrap().len());
    let response = serde_json::json!({"id": id, "object": "response", "status": "completed", "upstream": s.name});
    if req["stream"] != serde_json::json!(true) {
        return reply(&s.name, StatusCode::OK, response.to_string());
    }
    let mut events = String::new();
    for kind in ["response.created", "response.completed"] {
        let event = serde_json::json!({"type": kind, "response": response});
        events.push_str(&format!("event: {kind}\ndata: {event}\n\n"));
    }
    Response::builder()
        .status(200)
        .header("content-type", "text/event-stream")
        .header("x-upstream", &s.name)
        .body(Body::from(events))
        .unwrap()
}

fn reply(name: &str, status: StatusCode, body: String) -> Response {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-upstream", name)
        .body(Body::from(body))
        .unwrap()
}

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

/// The real `prefixlb` binary, on its own ports, killed when dropped.
pub struct Proxy {
    child: Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub dir: tempfile::TempDir,
}

impl Proxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn peers(&self) -> serde_json::Value {
        reqwest::get(format!("http://{}/admin/peers", self.admin))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub async fn in_flight_of(&self, addr: &str) -> u64 {
        let peers = self.peers().await;
        peers["peers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["address"] == addr)
            .map(|p| p["in_flight"].as_u64().unwrap())
            .unwrap()
    }

    /// Waits (at most `limit`) until nothing is in flight; returns the last listing. Idle means
    /// the total and every peer at 0: a listing reads each peer and then the total, so a slot
    /// released between the two reads shows on its peer and not in the total.
    pub async fn wait_idle(&self, limit: Duration) -> serde_json::Value {
        let start = Instant::now();
        loop {
            let peers = self.peers().await;
            let idle = peers["in_flight"] == 0
                && peers["peers"]
                    .as_array()
                    .is_some_and(|ps| ps.iter().all(|p| p["in_flight"] == 0));
            if idle || start.elapsed() > limit {
                return peers;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The path of the proxy's own configuration file.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("prefixlb.yaml")
    }

    /// Rewrites the proxy's configuration file as `config`, on the ports it has.
    pub fn rewrite_config(&self, config: &TestConfig) {
        std::fs::write(
            self.config_path(),
            proxy_file(config, self.addr, self.admin),
        )
        .unwrap();
    }

    /// What the proxy wrote to standard output: its access log.
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stdout.log")).unwrap_or_default()
    }

    /// The access log once `done` holds for it (its writer runs apart from the requests), or
    /// as it is after 5 s.
    pub async fn access_log_when(&self, done: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let log = self.access_log();
            if done(&log) || start.elapsed() > Duration::from_secs(5) {
                return log;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub async fn metrics(&self) -> String {
        reqwest::get(format!("http://{}/metrics", self.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Asserts that every slot is released within 5 s.
    pub async fn assert_idle(&self) {
        let listing = self.wait_idle(Duration::from_secs(5)).await;
        assert_eq!(listing["in_flight"], 0, "slots still held: {listing}");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    pub fn signal(&self, signal: &str) {
        send_signal(self.pid(), signal);
    }

    /// Waits for the proxy to exit by itself; see [`exits`].
    pub async fn exits(&mut self, limit: Duration) -> Instant {
        exits(&mut self.child, limit).await
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits until the proxy and its admin listener answer.
    pub async fn wait_ready(&mut self) {
        assert!(self.came_up().await, "proxy did not start: {}", self.log());
    }

    /// Waits until the proxy and its admin listener answer; false when it exited first, or
    /// when another process answers on its admin port. Its ports were only looked up free, and a
    /// parallel test may have bound one before this process did.
    async fn came_up(&mut self) -> bool {
        let start = Instant::now();
        loop {
            if self.child.try_wait().unwrap().is_some() {
                return false;
            }
            if let Ok(r) = reqwest::get(format!("http://{}/admin/peers", self.admin)).await {
                // Its own answer: the listing, or a refusal for want of the admin token.
                let ours = r.status() == 401
                    || r.json::<serde_json::Value>()
                        .await
                        .is_ok_and(|v| v["peers"].is_array());
                if !ours {
                    return false;
                }
                if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                    return true;
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "proxy did not start: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The membership in a `/admin/peers` listing (address and weight, in its order), without
/// the live load that moves between two listings.
pub fn members(listing: serde_json::Value) -> Vec<(String, u64)> {
    listing["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["address"].as_str().unwrap().to_owned(),
                p["weight"].as_u64().unwrap(),
            )
        })
        .collect()
}

pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_prefixlb"))
}

/// Starts the proxy with `config` (its ports are the spawner's to set), and waits until it
/// answers.
pub async fn start_proxy(config: &TestConfig) -> Proxy {
    start_proxy_with(config, &PingoraConfig::new().grace_seconds(1, 1)).await
}

/// [`start_proxy`] with Pingora's settings `pingora`.
pub async fn start_proxy_with(config: &TestConfig, pingora: &PingoraConfig) -> Proxy {
    // On ports another test took in the meantime it fails to start: again, on others.
    for _ in 0..2 {
        let mut proxy = spawn_proxy(config, pingora);
        if proxy.came_up().await {
            return proxy;
        }
    }
    let mut proxy = spawn_proxy(config, pingora);
    proxy.wait_ready().await;
    proxy
}

/// Starts the proxy without waiting for it.
pub fn spawn_proxy(config: &TestConfig, pingora: &PingoraConfig) -> Proxy {
    spawn_proxy_adjusted(config, pingora, |_| {})
}

/// `config` as the proxy on `addr` with its admin API on `admin` reads it. Listeners the
/// configuration sets without an address serve on `addr`, and it serves there alone when it
/// sets none. Engine metrics are not read unless `config` sets them: a mock counts a stream
/// until its next event fails to go out, a moment after the proxy gave its slot back, and tests
/// count slots exactly.
fn proxy_file(config: &TestConfig, addr: SocketAddr, admin: SocketAddr) -> String {
    let mut config = config.clone().admin_on(admin);
    config = if config.has_listeners() {
        config.address_listeners(addr)
    } else {
        config.listen_on(addr)
    };
    if !config.has_engine_metrics() {
        config = config.engine_metrics(false);
    }
    config.to_yaml()
}

/// [`spawn_proxy`], with `adjust` applied to the command first. Pingora's `threads` is 2 unless
/// `pingora` sets it.
pub fn spawn_proxy_adjusted(
    config: &TestConfig,
    pingora: &PingoraConfig,
    adjust: impl FnOnce(&mut Command),
) -> Proxy {
    let dir = tempfile::tempdir().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let lb_path = dir.path().join("prefixlb.yaml");
    std::fs::write(&lb_path, proxy_file(config, addr, admin)).unwrap();
    let mut pingora = pingora
        .clone()
        .pid_file(&dir.path().join("p.pid"))
        .upgrade_sock(&dir.path().join("u.sock"));
    if !pingora.has_threads() {
        pingora = pingora.threads(2);
    }
    let pingora_path = dir.path().join("pingora.yaml");
    std::fs::write(&pingora_path, pingora.to_yaml()).unwrap();
    let mut command = Command::new(binary());
    adjust(&mut command);
    let child = command
        .arg("-l")
        .arg(&lb_path)
        .arg("-c")
        .arg(&pingora_path)
        .env(
            "RUST_LOG",
            std::env::var("PREFIXLB_TEST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdout(std::fs::File::create(dir.path().join("stdout.log")).unwrap())
        .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    Proxy {
        child,
        addr,
        admin,
        dir,
    }
}

/// Sends `signal` (a name `kill -s` takes: TERM, QUIT, HUP, INT) to `pid`.
pub fn send_signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -s {signal} {pid}");
}

/// Waits for `child` to exit by itself, cleanly, within `limit`; returns when it did.
pub async fn exits(child: &mut Child, limit: Duration) -> Instant {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "exited with {status}");
            return Instant::now();
        }
        assert!(
            start.elapsed() < limit,
            "process still running after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
    client()
        .post(proxy.url("/v1/chat/completions"))
        .header("x-mock-events", events.to_string())
        .header("x-mock-interval-ms", interval_ms.to_string())
        .body(chat("s", "q", 1, true))
        .send()
        .await
        .unwrap()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().build().unwrap()
}
