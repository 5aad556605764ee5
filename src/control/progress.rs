//! The sweep that finds wedged engines: each peer's progress (see
//! [`crate::routing::progress`]) looked at a few times per limit, off the request path; each
//! change is logged, and a peer moving again wakes the waiting line, as a slot freed would.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::router::Router;
use crate::routing::progress::Change;

/// Sweeps per limit: a peer is found wedged at most a tenth of the limit late.
const SWEEPS_PER_LIMIT: u32 = 10;

pub struct ProgressWatch {
    router: Arc<Router>,
    limit: Duration,
}

impl ProgressWatch {
    pub fn new(router: Arc<Router>, limit: Duration) -> Self {
        Self { router, limit }
    }

    fn sweep(&self) {
        let cluster = self.router.cluster();
        let mut recovered = false;
        for peer in cluster.peers() {
            match peer.check_progress(self.limit) {
                Some(Change::Wedged(silent)) => log::warn!(
                    "peer {} is wedged: {} requests on it and no byte from it for {} ms; \
                     no new request goes to it until it moves again",
                    peer.id(),
                    peer.in_flight(),
                    silent.as_millis()
                ),
                Some(Change::Recovered) => {
                    log::info!("peer {} is moving again: it takes requests", peer.id());
                    recovered = true;
                }
                None => {}
            }
        }
        if recovered {
            self.router.load().waiters().wake_fronts();
        }
    }
}

#[async_trait]
impl BackgroundService for ProgressWatch {
    async fn start(&self, shutdown: ShutdownWatch) {
        let every = (self.limit / SWEEPS_PER_LIMIT)
            .clamp(Duration::from_millis(20), Duration::from_secs(1));
        super::every(every, shutdown, || async { self.sweep() }).await;
    }
}
