//! Peers from the heartbeat registry in Redis (see [`crate::control::registry`]): every key
//! under the prefix is a live node, read every interval with a bounded wait.

use std::net::SocketAddr;
use std::time::Duration;

use async_trait::async_trait;

use super::source::{AtStart, PeerSource};
use crate::control::registry::{bounded, client, connected, RegistryEntry};
use crate::error::Error;
use crate::metrics;
use crate::routing::{PeerSpec, Weight, UNLIMITED};
use crate::settings::Registry;

/// The connection is kept between rounds and made again after any failure.
pub struct RegistrySource {
    settings: Registry,
    client: redis::Client,
    connection: Option<redis::aio::MultiplexedConnection>,
}

impl RegistrySource {
    pub fn new(settings: &Registry) -> Result<Self, Error> {
        Ok(Self {
            client: client(&settings.url, "discovery.redis.url")?,
            settings: settings.clone(),
            connection: None,
        })
    }

    async fn read(&mut self) -> Result<Vec<PeerSpec>, Error> {
        let result = bounded(self.round()).await;
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
        // Bytes, not text: one key or value that is not UTF-8 must cost its own entry only.
        let mut keys: Vec<Vec<u8>> = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
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
        let values: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
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
    fn entry(&self, key: &[u8], value: &[u8]) -> Option<PeerSpec> {
        let key = String::from_utf8_lossy(key);
        let addr = key.strip_prefix(&self.settings.prefix)?;
        let parsed = addr
            .parse::<SocketAddr>()
            .map_err(|e| e.to_string())
            .and_then(|addr| {
                let entry: RegistryEntry =
                    serde_json::from_slice(value).map_err(|e| e.to_string())?;
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

#[async_trait]
impl PeerSource for RegistrySource {
    fn label(&self) -> String {
        format!("redis {}*", self.settings.prefix)
    }

    fn interval(&self) -> Duration {
        self.settings.interval
    }

    fn at_start(&self) -> AtStart {
        AtStart::Tried
    }

    async fn peers(&mut self, _force: bool) -> Result<Option<Vec<PeerSpec>>, Error> {
        self.read().await.map(Some)
    }

    fn disconnect(&mut self) {
        self.connection = None;
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
