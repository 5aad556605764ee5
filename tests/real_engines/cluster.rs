//! Two real engines behind prefixlb, as each test starts them, and what the tests ask of that
//! set-up: chats through prefixlb, the access log's account of them, the engines' entries in
//! `/admin/peers`.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{start_proxy, Proxy, TestConfig};
use crate::llama::{Engine, Setup, MODEL};
use crate::stream::{self, Reply};

/// Two engines behind prefixlb, which reads their metrics pages every 200 ms, checks their
/// health every 200 ms and logs each request as JSON.
pub struct Cluster {
    pub engines: Vec<Engine>,
    pub proxy: Proxy,
    _logs: tempfile::TempDir,
}

impl Cluster {
    pub async fn start(setup: &Setup) -> Self {
        let logs = tempfile::tempdir().unwrap();
        let started = Instant::now();
        let engines = setup.engines(2, logs.path()).await;
        println!(
            "engines up in {:?} (each: {:?})",
            started.elapsed(),
            engines.iter().map(|e| e.started_in).collect::<Vec<_>>()
        );
        let config = TestConfig::new()
            .peers_at(engines.iter().map(|e| e.addr))
            .engine_metrics(true)
            .engine_metrics_interval_ms(200)
            .health_check_interval_ms(200)
            .health_check_timeout_ms(500)
            .discover_models(500)
            .access_log("json");
        let proxy = start_proxy(&config).await;
        let cluster = Self {
            engines,
            proxy,
            _logs: logs,
        };
        cluster.wait_for_models().await;
        cluster
    }

    /// Waits (at most 10 s) until prefixlb has learnt the engines' model from them.
    async fn wait_for_models(&self) {
        let start = Instant::now();
        loop {
            let models: Value = reqwest::get(self.proxy.url("/v1/models"))
                .await
                .unwrap()
                .json()
                .await
                .unwrap_or_default();
            if models["data"][0]["id"] == MODEL {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "prefixlb did not list the engines' model: {models}; {}",
                self.proxy.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A streamed chat through prefixlb.
    pub async fn chat(&self, messages: &[Value], max_tokens: u32) -> Reply {
        let body = json!({
            "model": MODEL,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let start = Instant::now();
        let response = stream::post(&self.proxy.url("/v1/chat/completions"), &body).await;
        stream::read(response, start).await
    }

    /// The access-log lines of the chats so far, once there are `n` of them (at most 5 s).
    pub async fn chats_logged(&self, n: usize) -> Vec<Value> {
        let chats = |log: &str| -> Vec<Value> {
            log.lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter(|l| l["path"] == "/v1/chat/completions")
                .collect()
        };
        let log = self
            .proxy
            .access_log_when(|log| chats(log).len() >= n)
            .await;
        let lines = chats(&log);
        assert_eq!(lines.len(), n, "chat lines in the access log: {log}");
        lines
    }

    /// The engine that served the `n`th chat (from 1), as the access log names it.
    pub async fn served(&self, n: usize) -> String {
        self.chats_logged(n).await[n - 1]["peer"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    pub fn engine_mut(&mut self, addr: &str) -> &mut Engine {
        self.engines
            .iter_mut()
            .find(|e| e.addr_str() == addr)
            .unwrap()
    }

    pub fn other(&self, addr: &str) -> String {
        self.engines
            .iter()
            .map(Engine::addr_str)
            .find(|a| a != addr)
            .unwrap()
    }

    /// The `/admin/peers` entry of the engine at `addr`.
    pub async fn peer(&self, addr: &str) -> Value {
        let listing = self.proxy.peers().await;
        listing["peers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["address"] == addr)
            .cloned()
            .unwrap()
    }

    /// Polls `addr`'s `/admin/peers` entry until `done` holds (at most `limit`).
    pub async fn until_peer(&self, addr: &str, limit: Duration, done: impl Fn(&Value) -> bool) {
        let start = Instant::now();
        loop {
            let peer = self.peer(addr).await;
            if done(&peer) {
                return;
            }
            assert!(start.elapsed() < limit, "not within {limit:?}: {peer}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
