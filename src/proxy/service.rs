//! The listening service around the proxy, with one change to Pingora's shutdown.
//!
//! When its listeners stop, Pingora drops every connection that waits for its next request.
//! One whose client has that request on the way, or that just finished a response the client
//! will follow with another, is cut under the client. Here the connections stay: a request that
//! arrives during the drain is answered (Pingora then sends `Connection: close`), and
//! [`crate::lifecycle`] ends the process once nothing has run for a moment.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::apps::{HttpServerApp, HttpServerOptions, ReusedHttpStream};
use pingora::protocols::http::ServerSession;
use pingora::proxy::{HttpProxy, ProxyHttp};
use pingora::server::configuration::ServerConf;
use pingora::server::ShutdownWatch;
use pingora::services::listening::Service;

use super::idle::IdleConnections;
use crate::lifecycle::Activity;

pub struct DrainingProxy<SV> {
    inner: Arc<HttpProxy<SV>>,
    activity: Arc<Activity>,
}

#[async_trait]
impl<SV> HttpServerApp for DrainingProxy<SV>
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

    /// Called once the listeners have stopped accepting. Pingora's own cleanup, which drops the
    /// idle connections, is left out on purpose.
    async fn http_cleanup(&self) {
        self.activity.close();
    }
}

/// The proxy as a Pingora service, to which listeners are added. With `h2c`, its plain
/// listeners take HTTP/2 from clients that start with its preface, and HTTP/1 as before.
pub fn proxy_service<SV>(
    conf: &Arc<ServerConf>,
    proxy: SV,
    activity: Arc<Activity>,
    h2c: bool,
    head_timeout: Duration,
) -> Service<IdleConnections<DrainingProxy<SV>>>
where
    SV: ProxyHttp + Send + Sync + 'static,
    SV::CTX: Send + Sync,
{
    let mut proxy = pingora::proxy::http_proxy(conf, proxy);
    let mut options = HttpServerOptions::default();
    options.h2c = h2c;
    // Pingora closes an idle HTTP/2 connection only when told after how long (h2c, or `h2` by
    // ALPN over TLS): as long as an idle HTTP/1 one.
    options.h2_idle_timeout = Some(super::idle::IDLE_LIMIT);
    proxy.server_options = Some(options);
    let inner = Arc::new(proxy);
    Service::new(
        "prefixlb proxy".into(),
        IdleConnections::new(DrainingProxy { inner, activity }, h2c, head_timeout),
    )
}
