//! The control plane's own requests to the engines (health checks, metrics pages), over the
//! same transport the proxy uses for each peer: plain HTTP, or TLS checked as configured.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::BytesMut;
use pingora::connectors::http::Connector;
use pingora::http::RequestHeader;
use pingora::upstreams::peer::HttpPeer;
use pingora_load_balancing::health_check::HealthCheck;
use pingora_load_balancing::Backend;

use crate::router::Router;
use crate::routing::Peer;
use crate::settings::UpstreamTls;

pub struct Probe {
    connector: Connector,
    tls: UpstreamTls,
}

impl Probe {
    pub fn new(tls: UpstreamTls) -> Self {
        Self {
            connector: Connector::new(None),
            tls,
        }
    }

    /// The body of `GET path` on `peer`, if it answers 200 within `timeout` and with at most
    /// `max_body` bytes; the connection is kept for `keep_idle` for the next one.
    pub async fn get(
        &self,
        peer: &Peer,
        path: &str,
        timeout: Duration,
        keep_idle: Duration,
        max_body: usize,
    ) -> Result<String, String> {
        let target = crate::tls::http_peer(peer, &self.tls);
        // Behind TLS, the name it is reached by: an ingress in front of it routes by it.
        let host = peer
            .tls()
            .map_or_else(|| peer.id().to_owned(), |n| n.as_str().to_owned());
        self.get_from(target, &host, path, timeout, keep_idle, max_body)
            .await
    }

    /// [`Self::get`] from any server, `host` being what its `Host` header says.
    pub async fn get_from(
        &self,
        mut target: HttpPeer,
        host: &str,
        path: &str,
        timeout: Duration,
        keep_idle: Duration,
        max_body: usize,
    ) -> Result<String, String> {
        target.options.connection_timeout = Some(timeout);
        target.options.total_connection_timeout = Some(timeout);
        target.options.read_timeout = Some(timeout);
        target.options.write_timeout = Some(timeout);
        target.options.idle_timeout = Some(keep_idle);
        let text = |e: Box<pingora::Error>| e.to_string();
        let (mut session, _) = self
            .connector
            .get_http_session(&target)
            .await
            .map_err(text)?;
        let mut request = RequestHeader::build("GET", path.as_bytes(), None).map_err(text)?;
        request
            .insert_header(http::header::HOST, host)
            .map_err(text)?;
        session
            .write_request_header(Box::new(request))
            .await
            .map_err(text)?;
        session.finish_request_body().await.map_err(text)?;
        session.read_response_header().await.map_err(text)?;
        let status = session.response_header().map_or(0, |h| h.status.as_u16());
        if status != 200 {
            return Err(format!("status {status}"));
        }
        let mut body = BytesMut::new();
        while let Some(chunk) = session.read_response_body().await.map_err(text)? {
            body.extend_from_slice(&chunk);
            if body.len() > max_body {
                return Err(format!("a body over {max_body} bytes"));
            }
        }
        self.connector
            .release_http_session(session, &target, Some(keep_idle))
            .await;
        String::from_utf8(body.to_vec()).map_err(|_| "a body that is not UTF-8".to_owned())
    }
}

/// The health check pingora-load-balancing runs: `GET path` answered 200, over the peer's
/// own transport.
pub struct HealthProbe {
    pub probe: Probe,
    pub router: Arc<Router>,
    pub path: String,
    pub timeout: Duration,
    pub interval: Duration,
    pub healthy_after: usize,
    pub unhealthy_after: usize,
}

/// Enough for any health answer; a larger one is not a health answer.
const MAX_HEALTH_BODY: usize = 64 * 1024;

#[async_trait]
impl HealthCheck for HealthProbe {
    async fn check(&self, target: &Backend) -> pingora::Result<()> {
        let id = target.addr.to_string();
        let Some(peer) = self.router.cluster().peer(&id).cloned() else {
            return pingora::Error::e_explain(pingora::ErrorType::InternalError, "not a member");
        };
        let keep = self.interval * 2;
        match self
            .probe
            .get(&peer, &self.path, self.timeout, keep, MAX_HEALTH_BODY)
            .await
        {
            Ok(_) => Ok(()),
            Err(why) => pingora::Error::e_explain(pingora::ErrorType::ConnectError, why),
        }
    }

    fn health_threshold(&self, success: bool) -> usize {
        if success {
            self.healthy_after
        } else {
            self.unhealthy_after
        }
    }
}
