//! Peers from Kubernetes: the ready endpoints of the EndpointSlices of one Service (or of the
//! Services a label selector matches), weighted by annotations on the slices or the Services.
//!
//! The control plane asks its source for the peers every interval ([`PeerSource`]); the API
//! server pushes changes down a watch. They meet in two background tasks, one per kind
//! (EndpointSlices for the addresses, Services for their annotations), each following its
//! kind ([`watch::follow`]: list, then watch, resumed or listed again when it breaks) into a
//! `tokio::sync::watch` channel. [`PeerSource::peers`] only looks at the channels: a change
//! reaches the router at the next tick, and a tick without one costs nothing, so the interval
//! can be short. The first call starts the tasks and waits for the first lists.
//!
//! The tasks and the client's connections belong to the runtime they were started on (the
//! start-up read runs on a runtime of its own): [`PeerSource::disconnect`] ends them, and the
//! next call starts them again on the caller's.

pub mod peers;
pub mod watch;

use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};
use tokio::sync::watch as channel;
use tokio::task::JoinHandle;

use super::source::{AtStart, PeerSource};
use crate::error::Error;
use crate::routing::PeerSpec;
use crate::settings::{KubeApi, KubeSelect, Kubernetes};
use peers::SERVICE_NAME;
use watch::{follow, Listing, Selectors};

/// How long the first call waits for the first lists before it reports that none came; the
/// tasks go on trying after that.
const FIRST_LIST_WAIT: Duration = Duration::from_secs(5);

const FIELD: &str = "discovery.kubernetes";

pub struct KubernetesSource {
    settings: Kubernetes,
    following: Option<Following>,
}

/// The two tasks that follow the API server, and what they have seen.
struct Following {
    slices: channel::Receiver<Listing<EndpointSlice>>,
    services: channel::Receiver<Listing<Service>>,
    tasks: [JoinHandle<()>; 2],
}

impl Drop for Following {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl KubernetesSource {
    /// Checks what can be checked before any runtime runs: a source that can never reach the
    /// API server (not in a pod, a kubeconfig that does not read) stops the start.
    pub fn new(settings: &Kubernetes) -> Result<Self, Error> {
        match &settings.api {
            KubeApi::InCluster => {
                in_cluster()?;
            }
            KubeApi::Kubeconfig { path, context } => {
                let file = Kubeconfig::read_from(path)
                    .map_err(|e| Error::new(field("kubeconfig"), e.to_string()))?;
                if let Some(context) = context {
                    if !file.contexts.iter().any(|c| c.name == *context) {
                        let reason = format!("{} has no context {context}", path.display());
                        return Err(Error::new(field("context"), reason));
                    }
                }
            }
            KubeApi::Server {
                url,
                token_file,
                ca_file,
            } => {
                server_url(url)?;
                for (name, file) in [("token_file", token_file), ("ca_file", ca_file)] {
                    if let Some(path) = file {
                        std::fs::metadata(path).map_err(|e| {
                            Error::new(field(name), format!("{}: {e}", path.display()))
                        })?;
                    }
                }
            }
        }
        Ok(Self {
            settings: settings.clone(),
            following: None,
        })
    }

    /// The client's configuration, read afresh: a kubeconfig's credentials may have changed.
    async fn config(&self) -> Result<Config, Error> {
        Ok(match &self.settings.api {
            KubeApi::InCluster => in_cluster()?,
            KubeApi::Kubeconfig { path, context } => {
                let fail =
                    |e: &dyn std::fmt::Display| Error::new(field("kubeconfig"), e.to_string());
                let file = Kubeconfig::read_from(path).map_err(|e| fail(&e))?;
                let options = KubeConfigOptions {
                    context: context.clone(),
                    ..Default::default()
                };
                Config::from_custom_kubeconfig(file, &options)
                    .await
                    .map_err(|e| fail(&e))?
            }
            KubeApi::Server {
                url,
                token_file,
                ca_file,
            } => {
                let mut config = Config::new(server_url(url)?);
                // kube reads it again every minute: a projected token rotates.
                config.auth_info.token_file = token_file.as_ref().map(|p| p.display().to_string());
                config.root_cert_file.clone_from(ca_file);
                config
            }
        })
    }

    /// Starts the tasks on the caller's runtime.
    async fn start(&self) -> Result<Following, Error> {
        let config = self.config().await?;
        let namespace = match &self.settings.namespace {
            Some(namespace) => namespace.clone(),
            None => config.default_namespace.clone(),
        };
        let client = Client::try_from(config).map_err(|e| Error::new(FIELD, e.to_string()))?;
        // The EndpointSlice controller labels each slice with its Service's name, and copies
        // the Service's own labels onto it: one selector finds both.
        let (slices, services) = match &self.settings.select {
            KubeSelect::Service(name) => (
                Selectors {
                    labels: Some(format!("{SERVICE_NAME}={name}")),
                    fields: None,
                },
                Selectors {
                    labels: None,
                    fields: Some(format!("metadata.name={name}")),
                },
            ),
            KubeSelect::Labels(labels) => {
                let selectors = Selectors {
                    labels: Some(labels.clone()),
                    fields: None,
                };
                (selectors.clone(), selectors)
            }
        };
        let (slices_tx, slices_rx) = channel::channel(Listing::default());
        let (services_tx, services_rx) = channel::channel(Listing::default());
        let slices_api: Api<EndpointSlice> = Api::namespaced(client.clone(), &namespace);
        let services_api: Api<Service> = Api::namespaced(client, &namespace);
        Ok(Following {
            slices: slices_rx,
            services: services_rx,
            tasks: [
                tokio::spawn(follow(slices_api, slices, slices_tx)),
                tokio::spawn(follow(services_api, services, services_tx)),
            ],
        })
    }

    /// The peers as the tasks have them, if they changed since the last call (or `force`).
    async fn current(&mut self, force: bool) -> Result<Option<Vec<PeerSpec>>, Error> {
        let first = self.following.is_none();
        if first {
            self.following = Some(self.start().await?);
        }
        let Some(following) = self.following.as_mut() else {
            return Ok(None);
        };
        if first {
            let answered = async {
                let _ = following.slices.wait_for(Listing::answered).await;
                let _ = following.services.wait_for(Listing::answered).await;
            };
            if tokio::time::timeout(FIRST_LIST_WAIT, answered)
                .await
                .is_err()
            {
                return Err(Error::new(
                    FIELD,
                    format!("the API server did not answer within {FIRST_LIST_WAIT:?}"),
                ));
            }
        } else {
            let changed = (
                following.slices.has_changed(),
                following.services.has_changed(),
            );
            match changed {
                (Ok(false), Ok(false)) if !force => return Ok(None),
                (Ok(_), Ok(_)) => {}
                // A task ended, which only a panic does: start again at the next call.
                _ => {
                    self.following = None;
                    return Err(Error::new(FIELD, "the watch stopped; starting it again"));
                }
            }
        }
        let slices = following.slices.borrow_and_update().clone();
        let services = following.services.borrow_and_update().clone();
        match (slices.objects, services.objects) {
            (Some(slices), Some(services)) => {
                Ok(Some(peers::peers(&self.settings, &slices, &services)))
            }
            _ => {
                let error = slices.error.or(services.error);
                Err(Error::new(
                    FIELD,
                    error.unwrap_or_else(|| "not listed yet".to_owned()),
                ))
            }
        }
    }
}

#[async_trait]
impl PeerSource for KubernetesSource {
    fn label(&self) -> String {
        let namespace = self.settings.namespace.as_deref().unwrap_or("(default)");
        match &self.settings.select {
            KubeSelect::Service(name) => format!("kubernetes service {namespace}/{name}"),
            KubeSelect::Labels(labels) => format!("kubernetes services {namespace}/{{{labels}}}"),
        }
    }

    fn interval(&self) -> Duration {
        self.settings.interval
    }

    fn at_start(&self) -> AtStart {
        AtStart::Tried
    }

    async fn peers(&mut self, force: bool) -> Result<Option<Vec<PeerSpec>>, Error> {
        self.current(force).await
    }

    fn disconnect(&mut self) {
        self.following = None;
    }
}

fn field(name: &str) -> String {
    format!("{FIELD}.{name}")
}

fn in_cluster() -> Result<Config, Error> {
    Config::incluster().map_err(|e| {
        Error::new(
            FIELD,
            format!("not in a pod with a service account ({e}): set kubeconfig or api_server"),
        )
    })
}

fn server_url(url: &str) -> Result<http::Uri, Error> {
    url.parse()
        .map_err(|e| Error::new(field("api_server"), format!("{url}: {e}")))
}
