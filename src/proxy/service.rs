//! The listening service around the proxy, with one change to Pingora's shutdown.
//!
//! When a Pingora server shuts down (after a graceful upgrade handed its sockets on), it stops
//! accepting and, in the same moment, drops every connection still waiting for its request
//! header. A client that connected a moment before, whose request bytes were still in flight,
//! sees its connection closed with nothing answered. Giving such connections a moment to
//! deliver their request closes that gap: they are served by the old process, with keep-alive
//! off, and only then are idle connections dropped.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, HttpServerOptions, ReusedHttpStream};
use pingora::protocols::http::ServerSession;
use pingora::proxy::{HttpProxy, ProxyHttp};
use pingora::server::configuration::ServerConf;
use pingora::server::ShutdownWatch;
use pingora::services::listening::Service;

/// How long connections accepted just before shutdown have to send their request header.
pub const SHUTDOWN_SETTLE: Duration = Duration::from_secs(1);

pub struct SettlingProxy<SV> {
    inner: Arc<HttpProxy<SV>>,
}

#[async_trait]
impl<SV> HttpServerApp for SettlingProxy<SV>
where
    SV: ProxyHttp + Send + Sync + 'static,
    SV::CTX: Send + Sync,
{
    async fn process_new_http(
        self: &Arc<Self>,
        session: ServerSession,
        shutdown: &ShutdownWatch,
    ) -> Option<ReusedHttpStream> {
        self.inner.process_new_http(session, shutdown).await
    }

    fn h2_options(&self) -> Option<pingora::protocols::http::v2::server::H2Options> {
        self.inner.h2_options()
    }

    fn server_options(&self) -> Option<&HttpServerOptions> {
        self.inner.server_options()
    }

    async fn http_cleanup(&self) {
        tokio::time::sleep(SHUTDOWN_SETTLE).await;
        self.inner.http_cleanup().await;
    }
}

/// The proxy as a Pingora service, to which listeners are added.
pub fn proxy_service<SV>(conf: &Arc<ServerConf>, proxy: SV) -> Service<SettlingProxy<SV>>
where
    SV: ProxyHttp + Send + Sync + 'static,
    SV::CTX: Send + Sync,
{
    let inner = Arc::new(pingora::proxy::http_proxy(conf, proxy));
    Service::new("prefixlb proxy".into(), SettlingProxy { inner })
}
