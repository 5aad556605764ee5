//! The edge: TLS and HTTP/2 from clients, TLS to engines, API keys and tenant limits, each
//! through the real binary on loopback, with certificates made here.

mod api_keys;
mod certificates;
mod client_tls;
#[path = "../common/mod.rs"]
mod common;
mod engine_tls;
mod http2;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::ServerName;

use common::*;

/// A leaf of `pki` in `dir`, and a configuration with a listener that serves it on the proxy's
/// port.
pub(crate) fn tls_listener(dir: &Path, pki: &Pki) -> (PathBuf, PathBuf, TestConfig) {
    let (cert, key) = pki.leaf();
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    put(&cert_path, &cert);
    put(&key_path, &key);
    let config = TestConfig::new().listen_tls(&cert_path, &key_path);
    (cert_path, key_path, config)
}

/// A CA of the test's own, a leaf of it in a scratch directory (kept while the test runs), and
/// a configuration that serves the leaf.
pub(crate) fn tls_test_listener() -> (Pki, tempfile::TempDir, TestConfig) {
    let pki = Pki::new("test ca");
    let certs = tempfile::tempdir().unwrap();
    let (_, _, listen) = tls_listener(certs.path(), &pki);
    (pki, certs, listen)
}

/// One client connection over TLS, HTTP/1.1 or HTTP/2 as ALPN chose.
pub(crate) enum Conn {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Conn {
    /// Connects offering `h2` (and HTTP/1.1) or HTTP/1.1 alone.
    async fn open(addr: SocketAddr, ca_pem: &str, h2: bool) -> std::io::Result<(Conn, Vec<u8>)> {
        let alpn: &[&[u8]] = if h2 {
            &[b"h2", b"http/1.1"]
        } else {
            &[b"http/1.1"]
        };
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let tls = tls_connector(ca_pem, alpn)
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await?;
        let chosen = tls.get_ref().1.alpn_protocol().unwrap_or_default().to_vec();
        let io = TokioIo::new(tls);
        let conn = if chosen == b"h2" {
            let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .unwrap();
            tokio::spawn(conn);
            Conn::H2(send)
        } else {
            let (send, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
            tokio::spawn(conn);
            Conn::H1(send)
        };
        Ok((conn, chosen))
    }

    /// HTTP/2 without TLS, by prior knowledge.
    async fn open_h2c(addr: SocketAddr) -> Conn {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(conn);
        Conn::H2(send)
    }

    async fn post(
        &mut self,
        path: &str,
        headers: &[(&str, String)],
        body: String,
    ) -> hyper::Response<Incoming> {
        let mut req = hyper::Request::post(match self {
            Conn::H1(_) => path.to_owned(),
            Conn::H2(_) => format!("https://localhost{path}"),
        })
        .header("content-type", "application/json");
        if let Conn::H1(_) = self {
            req = req.header("host", "localhost");
        }
        for (name, value) in headers {
            req = req.header(*name, value);
        }
        let req = req.body(Full::new(Bytes::from(body))).unwrap();
        match self {
            Conn::H1(s) => s.send_request(req).await.unwrap(),
            Conn::H2(s) => s.send_request(req).await.unwrap(),
        }
    }
}

pub(crate) fn stream_headers(events: u32, interval_ms: u32) -> Vec<(&'static str, String)> {
    vec![
        ("x-mock-events", events.to_string()),
        ("x-mock-interval-ms", interval_ms.to_string()),
    ]
}

/// The body's data frames, each with when it came.
pub(crate) async fn frames(mut body: Incoming) -> Vec<(Instant, Bytes)> {
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            out.push((Instant::now(), data));
        }
    }
    out
}

pub(crate) fn events_in(frames: &[(Instant, Bytes)]) -> usize {
    frames
        .iter()
        .map(|(_, b)| String::from_utf8_lossy(b).matches("data: {").count())
        .sum()
}
