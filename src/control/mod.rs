//! The control plane: follows the peer list (from a [`discovery`] source) and the peers'
//! health, and swaps a new cluster in when either changes. It runs as a Pingora background
//! service, off the request path.
//!
//! Health checks run through pingora-load-balancing: a `Backends` view over the current cluster
//! members with a [`probe::HealthProbe`] (each peer over its own transport, plain or TLS), in
//! a registry keyed by address alone, so that a peer keeps its health across weight changes and
//! reloads.

pub mod discovery;
pub mod engine;
pub mod models;
pub mod probe;
pub mod progress;
pub mod registry;
pub mod replicas;
pub mod watch;

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeSet, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use pingora_load_balancing::discovery::ServiceDiscovery;
use pingora_load_balancing::{Backend, Backends, HealthRegistry};
use tokio::sync::Mutex;

use crate::error::Error;
use crate::metrics;
use crate::router::Router;
use crate::settings::{HealthCheck, UpstreamTls};
use discovery::source::PeerSource;
use probe::{HealthProbe, Probe};

/// Runs `round` every `interval` (the first at once), off the request path, until shutdown; a
/// round that overruns delays the next rather than piling up.
pub async fn every<F, Fut>(interval: Duration, mut shutdown: ShutdownWatch, mut round: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tick.tick() => round().await,
        }
    }
}

pub struct ControlPlane {
    router: Arc<Router>,
    source: Mutex<Box<dyn PeerSource>>,
    allow_empty: bool,
    health: Option<(Arc<HealthRegistry>, Duration)>,
    backends: Backends,
}

/// The health checker's view of the membership: whatever the router's cluster holds now.
struct Members(Arc<Router>);

#[async_trait]
impl ServiceDiscovery for Members {
    async fn discover(&self) -> pingora::Result<(BTreeSet<Backend>, HashMap<u64, bool>)> {
        let set = self.0.cluster().ring().peers().iter().cloned().collect();
        Ok((set, HashMap::new()))
    }
}

fn address_key(backend: &Backend) -> u64 {
    let mut h = DefaultHasher::new();
    backend.addr.hash(&mut h);
    h.finish()
}

impl ControlPlane {
    pub fn new(
        router: Arc<Router>,
        source: Box<dyn PeerSource>,
        allow_empty: bool,
        health: Option<&HealthCheck>,
        tls: &UpstreamTls,
    ) -> pingora::Result<Self> {
        let registry = Arc::new(HealthRegistry::with_equivalence(address_key));
        let health = if let Some(health) = health {
            registry.set_health_check(Box::new(HealthProbe {
                probe: Probe::new(tls.clone()),
                router: Arc::clone(&router),
                path: health.path.clone(),
                timeout: health.timeout,
                interval: health.interval,
                healthy_after: health.healthy_after,
                unhealthy_after: health.unhealthy_after,
            }));
            Some((Arc::clone(&registry), health.interval))
        } else {
            None
        };
        let backends =
            Backends::new_with_health_registry(Box::new(Members(Arc::clone(&router))), registry);
        Ok(Self {
            router,
            source: Mutex::new(source),
            allow_empty,
            health,
            backends,
        })
    }

    /// Reads the peer source again and swaps in a new cluster if the list changed. An invalid
    /// list leaves the current one in place. Returns whether the peers changed.
    pub async fn reload(&self, force: bool) -> Result<bool, Error> {
        let mut source = self.source.lock().await;
        let loaded = source.peers(force).await.inspect_err(|_| {
            metrics::RELOADS.with_label_values(&["error"]).inc();
        })?;
        let Some(specs) = loaded else {
            return Ok(false);
        };
        let current = self.router.cluster().peers().len();
        if specs.is_empty() && current > 0 && !self.allow_empty {
            metrics::RELOADS.with_label_values(&["error"]).inc();
            return Err(Error::new(
                "peers",
                format!(
                    "the new list is empty: keeping the {current} current peers (discovery.allow_empty: true allows an empty list)"
                ),
            ));
        }
        let Some(change) = self.router.set_peers(specs) else {
            metrics::RELOADS.with_label_values(&["unchanged"]).inc();
            return Ok(false);
        };
        metrics::RELOADS.with_label_values(&["changed"]).inc();
        for gone in &change.removed {
            metrics::forget_peer(gone);
        }
        self.sync_membership().await;
        log::info!("peers from {}: now {} peers", source.label(), change.peers);
        Ok(true)
    }

    async fn sync_membership(&self) {
        if let Err(e) = self.backends.update(|_| ()).await {
            log::warn!("health checker could not take the new peers: {e}");
        }
        self.sync_health();
    }

    fn sync_health(&self) {
        if self.health.is_some() {
            self.router.sync_health(|b| self.backends.ready(b));
        } else {
            self.router.refresh();
        }
    }

    async fn reload_loop(&self, mut shutdown: ShutdownWatch) {
        let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            Ok(s) => Some(s),
            Err(e) => {
                log::warn!("cannot listen for SIGHUP, reloads follow file changes only: {e}");
                None
            }
        };
        let label = self.source.lock().await.label();
        let mut tick = tokio::time::interval(self.source.lock().await.interval());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let force = tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => false,
                Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => None } } => {
                    log::info!("SIGHUP: reloading peers from {label}");
                    true
                }
            };
            // Ejections end by the clock, with nobody told: count the peers back in, and let
            // the waiting line look again.
            self.router.refresh_and_wake();
            if let Err(e) = self.reload(force).await {
                log::error!("peers from {label} not reloaded, keeping the current ones: {e}");
            }
        }
    }

    async fn health_loop(&self, mut shutdown: ShutdownWatch) {
        let Some((registry, interval)) = &self.health else {
            return;
        };
        let mut tick = tokio::time::interval(*interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tick.tick() => {}
            }
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = registry.run_health_check(true) => {}
            }
            self.sync_health();
        }
    }
}

#[async_trait]
impl BackgroundService for ControlPlane {
    async fn start(&self, shutdown: ShutdownWatch) {
        self.sync_membership().await;
        tokio::join!(
            self.reload_loop(shutdown.clone()),
            self.health_loop(shutdown)
        );
    }
}
