//! Where the proxy listens, and who may use it: its listeners, their certificates, and client
//! authentication by API key.

use std::net::SocketAddr;
use std::path::PathBuf;

/// One address the proxy listens on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    pub addr: SocketAddr,
    pub tls: Option<TlsFiles>,
}

/// A certificate chain and its private key, in PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Client authentication by API key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Auth {
    /// The keys (as SHA-256 digests) and each key's limits; read again when it changes.
    pub keys_file: PathBuf,
    /// Whether the client's `Authorization` header goes on to the engine.
    pub forward_key: bool,
}
