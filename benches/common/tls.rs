//! TLS for the benches: a certificate made for the run, and client connections over it or in
//! the clear.

use std::net::SocketAddr;
use std::path::PathBuf;

use super::support::{put, Pki};

/// The certificate a TLS listener is served with, and its CA for the clients.
pub struct Certs {
    _dir: tempfile::TempDir,
    pub ca_pem: String,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Chain and key in one file, as HAProxy takes them.
    pub combined: PathBuf,
}

pub fn make_certs() -> Certs {
    let dir = tempfile::tempdir().expect("a directory");
    let pki = Pki::new("bench ca");
    let (cert, key) = pki.leaf();
    let path = |name: &str| dir.path().join(name);
    put(&path("cert.pem"), &cert);
    put(&path("key.pem"), &key);
    put(&path("combined.pem"), &format!("{cert}{key}"));
    Certs {
        ca_pem: pki.ca_pem(),
        cert: path("cert.pem"),
        key: path("key.pem"),
        combined: path("combined.pem"),
        _dir: dir,
    }
}

pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// A connection to `target`, over TLS when `tls` is given.
pub async fn open(
    target: SocketAddr,
    tls: Option<&tokio_rustls::TlsConnector>,
) -> Result<Box<dyn Io>, String> {
    let tcp = tokio::net::TcpStream::connect(target)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let _ = tcp.set_nodelay(true);
    Ok(match tls {
        Some(tls) => Box::new(
            tls.connect(localhost(), tcp)
                .await
                .map_err(|e| format!("handshake: {e}"))?,
        ),
        None => Box::new(tcp),
    })
}

pub fn localhost() -> rustls::pki_types::ServerName<'static> {
    rustls::pki_types::ServerName::try_from("localhost").expect("a name")
}
