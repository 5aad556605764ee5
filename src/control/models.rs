//! Which models each peer serves, asked of the peers that are not listed with theirs: their
//! OpenAI-style `GET /v1/models` (vLLM lists its loaded LoRA adapters there too), on an
//! interval, off the request path. A peer that does not answer keeps what it said last, or
//! serves any model until it has said.

use std::sync::Arc;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde::Deserialize;

use super::probe::Probe;
use crate::router::Router;
use crate::settings::{ModelDiscovery, UpstreamTls};

/// The most of a model list read.
const MAX_LIST: usize = 1024 * 1024;

pub struct ModelLists {
    router: Arc<Router>,
    settings: ModelDiscovery,
    probe: Probe,
}

#[derive(Deserialize)]
struct List {
    data: Vec<Entry>,
}

#[derive(Deserialize)]
struct Entry {
    id: String,
}

/// The model ids of an OpenAI-style model list, sorted.
pub fn parse(body: &str) -> Result<Vec<String>, String> {
    let list: List = serde_json::from_str(body).map_err(|e| e.to_string())?;
    let mut ids: Vec<String> = list.data.into_iter().map(|e| e.id).collect();
    ids.sort();
    ids.dedup();
    Ok(ids)
}

impl ModelLists {
    pub fn new(router: Arc<Router>, settings: ModelDiscovery, tls: UpstreamTls) -> Self {
        Self {
            router,
            settings,
            probe: Probe::new(tls),
        }
    }

    async fn ask_all(&self) {
        let cluster = self.router.cluster();
        let asks = self
            .router
            .unlisted_models()
            .into_iter()
            .filter_map(|addr| {
                let peer = Arc::clone(cluster.peer(&addr.to_string())?);
                Some(async move {
                    let s = &self.settings;
                    let keep = s.interval * 2;
                    let answer = self
                        .probe
                        .get(&peer, "/v1/models", s.timeout, keep, MAX_LIST)
                        .await
                        .and_then(|body| parse(&body));
                    match answer {
                        Ok(models) => {
                            if self.router.set_discovered_models(addr, models.clone()) {
                                log::info!("{addr} serves {}", models.join(", "));
                            }
                        }
                        Err(e) => log::debug!("{addr}: no model list ({e})"),
                    }
                })
            });
        futures_util::future::join_all(asks).await;
    }
}

#[async_trait]
impl BackgroundService for ModelLists {
    async fn start(&self, shutdown: ShutdownWatch) {
        super::every(self.settings.interval, shutdown, || self.ask_all()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vllm_model_list_gives_its_base_model_and_adapters() {
        let body = r#"{"object":"list","data":[
            {"id":"meta-llama/Llama-3.1-8B","object":"model","owned_by":"vllm","parent":null},
            {"id":"sql-lora","object":"model","owned_by":"vllm","parent":"meta-llama/Llama-3.1-8B"}]}"#;
        assert_eq!(
            parse(body).unwrap(),
            ["meta-llama/Llama-3.1-8B", "sql-lora"]
        );
        assert!(parse("{}").is_err());
        assert!(parse("not json").is_err());
    }
}
