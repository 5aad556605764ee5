//! The seed's control plane: a registry of engine nodes in Redis, one key per node
//! (`prefix<addr>`, holding `{"weight": …, "max_in_flight": …, "models": […]}`) that expires unless the
//! node's agent refreshes it. prefixlb reads the registry on an interval, off the request path
//! ([`RegistrySource`](super::discovery::redis::RegistrySource)); [`Heartbeat`] is the agent's
//! side, run by `prefixlb-agent` next to each engine.

use std::future::Future;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Longest one round of the registry may take: a Redis that hangs is a Redis that fails.
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(2);

/// `work`'s result, or an error if Redis has not answered within [`REGISTRY_TIMEOUT`].
pub(crate) async fn bounded<T>(work: impl Future<Output = Result<T, String>>) -> Result<T, String> {
    match tokio::time::timeout(REGISTRY_TIMEOUT, work).await {
        Ok(r) => r,
        Err(_) => Err(format!("no answer within {REGISTRY_TIMEOUT:?}")),
    }
}

/// What a node's key holds; fields it does not know are left for newer agents.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RegistryEntry {
    #[serde(default = "one")]
    pub weight: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u32>,
    /// The models (and adapters) it serves; absent: asked of it, or any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
}

fn one() -> u32 {
    1
}

/// The connection kept in `slot`, made first if there is none.
pub(crate) async fn connected<'a>(
    client: &redis::Client,
    slot: &'a mut Option<redis::aio::MultiplexedConnection>,
) -> Result<&'a mut redis::aio::MultiplexedConnection, String> {
    match slot {
        Some(connection) => Ok(connection),
        None => {
            let made = client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| e.to_string())?;
            Ok(slot.insert(made))
        }
    }
}

pub(crate) fn client(url: &str, field: &str) -> Result<redis::Client, Error> {
    redis::Client::open(url).map_err(|e| Error::new(field, e.to_string()))
}

/// The key a node is registered under.
fn key(prefix: &str, addr: &str) -> String {
    format!("{prefix}{addr}")
}

/// An agent's side of the registry: it writes its node's key, with a time to live, while the
/// engine is healthy, and deletes it when the engine is not, or the agent stops or drains.
pub struct Heartbeat {
    client: redis::Client,
    connection: Option<redis::aio::MultiplexedConnection>,
    key: String,
    value: String,
    ttl: Duration,
}

impl Heartbeat {
    pub fn new(
        url: &str,
        prefix: &str,
        advertise: &str,
        entry: &RegistryEntry,
        ttl: Duration,
    ) -> Result<Self, Error> {
        Ok(Self {
            client: client(url, "--redis")?,
            connection: None,
            key: key(prefix, advertise),
            value: serde_json::to_string(entry).map_err(|e| Error::new("entry", e.to_string()))?,
            ttl,
        })
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    /// Writes the key for another time to live.
    pub async fn beat(&mut self) -> Result<(), String> {
        let ttl = self.ttl.as_millis() as u64;
        let (key, value) = (self.key.clone(), self.value.clone());
        self.command(redis::cmd("SET").arg(key).arg(value).arg("PX").arg(ttl))
            .await
    }

    /// Deletes the key: the node leaves the registry at once, not when its time runs out.
    pub async fn leave(&mut self) -> Result<(), String> {
        let key = self.key.clone();
        self.command(redis::cmd("DEL").arg(key)).await
    }

    async fn command(&mut self, command: &mut redis::Cmd) -> Result<(), String> {
        let run = async {
            let connection = connected(&self.client, &mut self.connection).await?;
            command
                .query_async::<()>(connection)
                .await
                .map_err(|e| e.to_string())
        };
        let result = bounded(run).await;
        if result.is_err() {
            self.connection = None;
        }
        result
    }
}
