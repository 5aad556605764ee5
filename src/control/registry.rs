//! The seed's control plane: a registry of engine nodes in Redis, one key per node
//! (`prefix<addr>`, holding `{"weight": …, "max_in_flight": …, "models": […]}`) that expires unless the
//! node's agent refreshes it. prefixlb reads the registry on an interval, off the request path;
//! [`Heartbeat`] is the agent's side, run by `prefixlb-agent` next to each engine.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Error;
use crate::metrics;
use crate::routing::{PeerSpec, Weight, UNLIMITED};
use crate::settings::Registry;

/// The heartbeat registry: one key per engine node, which expires unless its agent refreshes
/// it. The connection is kept between rounds and made again after any failure.
pub struct RegistrySource {
    settings: Registry,
    client: redis::Client,
    connection: Option<redis::aio::MultiplexedConnection>,
}

/// Longest one round of the registry may take: a Redis that hangs is a Redis that fails.
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(2);

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

impl RegistrySource {
    pub fn new(settings: &Registry) -> Result<Self, Error> {
        Ok(Self {
            client: client(&settings.url, "discovery.redis.url")?,
            settings: settings.clone(),
            connection: None,
        })
    }

    pub fn label(&self) -> String {
        format!("redis {}*", self.settings.prefix)
    }

    pub fn disconnect(&mut self) {
        self.connection = None;
    }

    pub fn interval(&self) -> Duration {
        self.settings.interval
    }

    pub async fn read(&mut self) -> Result<Vec<PeerSpec>, Error> {
        let round = tokio::time::timeout(REGISTRY_TIMEOUT, self.round()).await;
        let result = match round {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {REGISTRY_TIMEOUT:?}")),
        };
        result.map_err(|e| {
            // The next round connects afresh.
            self.connection = None;
            metrics::REGISTRY_FAILURES.inc();
            Error::new(
                "discovery.redis",
                format!("{}: {e}", self.settings.url_without_secret()),
            )
        })
    }

    async fn round(&mut self) -> Result<Vec<PeerSpec>, String> {
        let text = |e: redis::RedisError| e.to_string();
        let connection = connected(&self.client, &mut self.connection).await?;
        let pattern = format!("{}*", escape_glob(&self.settings.prefix));
        let mut keys: Vec<String> = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(connection)
                .await
                .map_err(text)?;
            keys.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        keys.sort();
        keys.dedup();
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let values: Vec<Option<String>> = redis::cmd("MGET")
            .arg(&keys)
            .query_async(connection)
            .await
            .map_err(text)?;
        // A key that expired between the scan and the read is simply gone.
        Ok(keys
            .iter()
            .zip(values)
            .filter_map(|(key, value)| self.entry(key, value.as_deref()?))
            .collect())
    }

    /// The peer a node's key names; a bad entry is skipped with a warning, not the whole list.
    fn entry(&self, key: &str, value: &str) -> Option<PeerSpec> {
        let addr = key.strip_prefix(&self.settings.prefix)?;
        let parsed = addr
            .parse::<SocketAddr>()
            .map_err(|e| e.to_string())
            .and_then(|addr| {
                let entry: RegistryEntry =
                    serde_json::from_str(value).map_err(|e| e.to_string())?;
                let weight = Weight::new(entry.weight)
                    .ok_or_else(|| format!("weight {} is not 1 to 100", entry.weight))?;
                Ok(PeerSpec {
                    addr,
                    weight,
                    max_in_flight: match entry.max_in_flight {
                        Some(0) => return Err("max_in_flight 0".to_owned()),
                        Some(n) => n,
                        None => UNLIMITED,
                    },
                    tls: None,
                    models: entry.models,
                })
            });
        parsed
            .inspect_err(|e| log::warn!("registry key {key} skipped: {e}"))
            .ok()
    }
}

/// `prefix` as a glob that matches it literally.
fn escape_glob(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len());
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The connection kept in `slot`, made first if there is none.
async fn connected<'a>(
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

fn client(url: &str, field: &str) -> Result<redis::Client, Error> {
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
        let result = match tokio::time::timeout(REGISTRY_TIMEOUT, run).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {REGISTRY_TIMEOUT:?}")),
        };
        if result.is_err() {
            self.connection = None;
        }
        result
    }
}
