//! TLS, through Pingora's rustls backend: rustls with ring needs no system TLS library and no
//! C toolchain beyond what the build already has, so a fresh machine builds it as it is.
//!
//! A listener's certificate lives in a [`CertStore`] that the handshake asks each time, so a
//! renewed certificate is taken by the next handshake while open connections go on with the
//! one they started with. Engines behind TLS are reached with the CA bundle configured for
//! them, or the system's roots.

use std::sync::Arc;

use arc_swap::ArcSwap;
use pingora::listeners::tls::TlsSettings;
use pingora::utils::tls::WrappedX509;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

use crate::error::Error;
use crate::routing::Peer;
use crate::settings::{TlsFiles, UpstreamTls};
use pingora::upstreams::peer::HttpPeer;

/// A listener's certificate chain and key as they are now.
#[derive(Debug)]
pub struct CertStore {
    current: ArcSwap<CertifiedKey>,
}

impl CertStore {
    pub fn new(cert_pem: &[u8], key_pem: &[u8]) -> Result<Self, Error> {
        Ok(Self {
            current: ArcSwap::from_pointee(certified_key(cert_pem, key_pem)?),
        })
    }

    /// Takes a new pair, once it is whole and its key matches its certificate.
    pub fn replace(&self, cert_pem: &[u8], key_pem: &[u8]) -> Result<(), Error> {
        self.current
            .store(Arc::new(certified_key(cert_pem, key_pem)?));
        Ok(())
    }

    /// What a listener's handshakes are set up with: TLS 1.2 and 1.3, HTTP/2 offered first,
    /// and the certificate asked of this store each time.
    pub fn listener_settings(self: &Arc<Self>, files: &TlsFiles) -> pingora::Result<TlsSettings> {
        let path = |p: &std::path::Path| p.to_string_lossy().into_owned();
        let mut settings = TlsSettings::intermediate(&path(&files.cert), &path(&files.key))?;
        settings.set_cert_resolver(Arc::clone(self) as Arc<dyn ResolvesServerCert>);
        settings.enable_h2();
        Ok(settings)
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, Error> {
    let chain = certificates(cert_pem, "tls.cert")?;
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| Error::new("tls.key", format!("no private key in PEM: {e}")))?;
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(chain, key, &provider).map_err(|e| {
        Error::new(
            "tls",
            format!("certificate and key do not go together: {e}"),
        )
    })
}

fn certificates(pem: &[u8], field: &str) -> Result<Vec<CertificateDer<'static>>, Error> {
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::new(field, format!("unreadable PEM: {e}")))?;
    if chain.is_empty() {
        return Err(Error::new(field, "no certificate in PEM"));
    }
    Ok(chain)
}

/// The CA certificates an engine's certificate is checked against, in Pingora's form.
pub fn ca_bundle(pem: &[u8]) -> Result<Arc<[WrappedX509]>, Error> {
    let field = "upstream.tls.ca_file";
    certificates(pem, field)?
        .into_iter()
        .map(|der| {
            // Pingora's parser panics on what it cannot read: rustls reads it first.
            rustls::RootCertStore::empty()
                .add(der.clone())
                .map_err(|e| Error::new(field, format!("not a CA certificate: {e}")))?;
            Ok(WrappedX509::new(der.to_vec(), |raw| {
                pingora::utils::tls::parse_x509(raw)
            }))
        })
        .collect()
}

/// The peer as Pingora connects to it: over TLS when it is configured so, checked for its name
/// against `tls`'s CA certificates (or the system's).
pub fn http_peer(peer: &Peer, tls: &UpstreamTls) -> HttpPeer {
    match peer.tls() {
        Some(name) => {
            let mut target = HttpPeer::new(peer.addr(), true, name.as_str().to_owned());
            target.options.ca = tls.ca.clone();
            target.options.verify_cert = tls.verify;
            target.options.verify_hostname = tls.verify;
            target
        }
        None => HttpPeer::new(peer.addr(), false, String::new()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        (params.self_signed(&key).unwrap().pem(), key.serialize_pem())
    }

    #[test]
    fn a_pair_whose_halves_do_not_match_is_refused_and_the_old_one_stays() {
        let (cert_a, key_a) = pair();
        let (cert_b, key_b) = pair();
        let store = CertStore::new(cert_a.as_bytes(), key_a.as_bytes()).unwrap();
        let before = store.current.load_full();
        let e = store
            .replace(cert_b.as_bytes(), key_a.as_bytes())
            .unwrap_err();
        assert!(e.to_string().contains("do not go together"), "{e}");
        assert!(store.replace(b"", key_b.as_bytes()).is_err());
        assert!(store.replace(cert_b.as_bytes(), b"junk").is_err());
        assert!(Arc::ptr_eq(&before, &store.current.load_full()));
        store.replace(cert_b.as_bytes(), key_b.as_bytes()).unwrap();
        assert!(!Arc::ptr_eq(&before, &store.current.load_full()));
    }

    #[test]
    fn a_ca_bundle_must_hold_readable_certificates() {
        let (cert, _) = pair();
        assert_eq!(
            ca_bundle(format!("{cert}{cert}").as_bytes()).unwrap().len(),
            2
        );
        assert!(ca_bundle(b"").is_err());
        let garbage = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        assert!(ca_bundle(garbage.as_bytes()).is_err());
    }
}
