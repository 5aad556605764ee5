//! What the proxy holds for every request: the routing core, the settings, and the shared state
//! the request filter's steps and the later hooks read.

use std::sync::Arc;

use super::forwarding::Forwarding;
use super::peek::PeekMemory;
use super::shared_load::SharedLoad;
use crate::access_log::AccessLog;
use crate::lifecycle::Activity;
use crate::metrics;
use crate::router::Router;
use crate::routing::{Peer, ResponseHomes};
use crate::settings::ProxySettings;
use crate::tenants::ClientAuth;
use crate::traces::Traces;

/// The proxy Pingora runs: one for the process, read by every request.
pub struct PrefixLb {
    pub(crate) router: Arc<Router>,
    pub(crate) settings: ProxySettings,
    pub(crate) access_log: AccessLog,
    pub(crate) forwarding: Forwarding,
    pub(crate) peek_memory: Arc<PeekMemory>,
    pub(crate) activity: Arc<Activity>,
    pub(crate) shared: Arc<SharedLoad>,
    pub(crate) auth: Option<ClientAuth>,
    /// `None` when traces are off: then no request makes a span.
    pub(crate) traces: Option<Arc<Traces>>,
    /// Which peer made each stored Responses API response forwarded lately.
    pub(crate) responses: ResponseHomes,
}

impl PrefixLb {
    pub fn new(
        router: Arc<Router>,
        settings: ProxySettings,
        activity: Arc<Activity>,
        shared: Arc<SharedLoad>,
    ) -> Self {
        Self {
            router,
            access_log: AccessLog::new(settings.access_log, settings.access_log_key.as_deref()),
            forwarding: Forwarding::new(settings.forwarding.clone()),
            peek_memory: PeekMemory::new(settings.peek.memory),
            settings,
            activity,
            shared,
            auth: None,
            traces: None,
            responses: ResponseHomes::default(),
        }
    }

    /// Serves only clients with a listed API key, each within its tenant's limits.
    pub fn with_auth(self, auth: ClientAuth) -> Self {
        Self {
            auth: Some(auth),
            ..self
        }
    }

    /// Makes a span of each request, sent to a collector.
    pub fn with_traces(self, traces: Arc<Traces>) -> Self {
        Self {
            traces: Some(traces),
            ..self
        }
    }

    /// Counts a failed request against `peer`, and says so when that ejected it.
    pub(crate) fn peer_failed(&self, peer: &Peer) {
        if let Some(backoff) = self.router.peer_failed(peer) {
            metrics::count_on_peer(&metrics::PEER_EJECTIONS, peer.id(), || peer.removed());
            log::warn!(
                "ejecting peer {} for {backoff:?}: repeated failures",
                peer.id()
            );
        }
    }
}
