//! The command line of `gpu-sim`, and serving what it asks for: one simulated GPU per
//! `--listen` address. The benchmarks serve it in their own process through [`serve`].

use std::net::SocketAddr;
use std::sync::Arc;

use axum::serve::ListenerExt;
use clap::Parser;

use crate::{server, Gpu, Model, SimConfig};

#[derive(Parser, Debug)]
#[command(
    name = "gpu-sim",
    version,
    about = "Simulated LLM inference servers for prefixlb's demo and benchmarks"
)]
pub struct Args {
    /// An address to serve one simulated GPU on; repeat for more GPUs.
    #[arg(long = "listen", default_values = ["127.0.0.1:8001", "127.0.0.1:8002"])]
    pub listen: Vec<SocketAddr>,
    /// How each GPU schedules its work: `lane` (one prefill lane) or `engine` (chunked
    /// prefill steps, KV memory held by running requests, preemption).
    #[arg(long, value_enum, default_value_t = Model::Lane)]
    pub sim_model: Model,
    /// Each GPU's speed relative to the others, in `--listen` order (0.5: every duration
    /// doubles); GPUs beyond the list run at 1.
    #[arg(long, value_delimiter = ',')]
    pub pace: Vec<f64>,
    /// Characters of prompt text per token (default: 4 for `lane`, 3.3 for `engine`).
    #[arg(long)]
    pub chars_per_token: Option<f64>,
    /// Engine model: tokens one step computes at most (vLLM's `max_num_batched_tokens`).
    #[arg(long, default_value_t = SimConfig::engine().max_batched_tokens)]
    pub max_batched_tokens: usize,
    /// Engine model: milliseconds of tokenisation and scheduling per request.
    #[arg(long, default_value_t = SimConfig::engine().request_overhead_ms)]
    pub request_overhead_ms: f64,
    /// The model name `/v1/models` reports.
    #[arg(long, default_value = "sim-llama-3-8b")]
    pub model: String,
    /// Prefix-cache capacity, in tokens (engine model: the KV pool that running requests
    /// and cached prefixes share).
    #[arg(long, default_value_t = SimConfig::default().cache_tokens)]
    pub cache_tokens: usize,
    #[arg(long, default_value_t = SimConfig::default().prefill_tokens_per_sec)]
    pub prefill_tokens_per_sec: f64,
    #[arg(long, default_value_t = SimConfig::default().decode_ms_per_token)]
    pub decode_ms_per_token: f64,
    /// Extra decode time per token for each other running request, as a fraction.
    #[arg(long, default_value_t = SimConfig::default().batch_slowdown)]
    pub batch_slowdown: f64,
    /// Lane model: prompt tokens each decode step also prefills while a prefill runs (0: none).
    #[arg(long, default_value_t = SimConfig::default().prefill_chunk_tokens)]
    pub prefill_chunk_tokens: usize,
    /// Requests running at once; more wait.
    #[arg(long, default_value_t = SimConfig::default().max_running)]
    pub max_running: usize,
    /// Output tokens when a request names no `max_tokens`.
    #[arg(long, default_value_t = SimConfig::default().default_max_tokens)]
    pub max_tokens: usize,
    /// Divides every duration: 10 runs ten times faster, ratios unchanged.
    #[arg(long, default_value_t = 1.0)]
    pub speed: f64,
}

impl Args {
    /// The configuration of every GPU but its pace.
    pub fn sim_config(&self) -> SimConfig {
        let base = match self.sim_model {
            Model::Lane => SimConfig::default(),
            Model::Engine => SimConfig::engine(),
        };
        SimConfig {
            chars_per_token: self.chars_per_token.unwrap_or(base.chars_per_token),
            max_batched_tokens: self.max_batched_tokens,
            request_overhead_ms: self.request_overhead_ms,
            cache_tokens: self.cache_tokens,
            prefill_tokens_per_sec: self.prefill_tokens_per_sec,
            decode_ms_per_token: self.decode_ms_per_token,
            batch_slowdown: self.batch_slowdown,
            prefill_chunk_tokens: self.prefill_chunk_tokens,
            max_running: self.max_running,
            default_max_tokens: self.max_tokens,
            speed: self.speed,
            ..base
        }
    }
}

/// Serves every `--listen` address until one server fails.
pub async fn serve(args: Args) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let config = args.sim_config();
    let mut servers = Vec::new();
    for (i, addr) in args.listen.into_iter().enumerate() {
        // Each token is a small write: without TCP_NODELAY, Nagle's algorithm would hold one
        // back until the previous is acknowledged, adding tens of milliseconds.
        let listener = tokio::net::TcpListener::bind(addr).await?.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let app = server::router(
            Arc::new(Gpu::new(SimConfig {
                pace: args.pace.get(i).copied().unwrap_or(1.0),
                ..config.clone()
            })),
            addr.to_string(),
            args.model.clone(),
        )?;
        eprintln!("gpu-sim: {} serving {addr}", args.model);
        servers.push(tokio::spawn(
            async move { axum::serve(listener, app).await },
        ));
    }
    for s in servers {
        s.await??;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engine_model_and_paces_are_chosen_on_the_command_line() {
        let args = Args::parse_from(["gpu-sim", "--sim-model", "engine", "--pace", "1,0.5"]);
        let c = args.sim_config();
        assert_eq!((c.model, c.chars_per_token), (Model::Engine, 3.3));
        assert_eq!(args.pace, [1.0, 0.5]);
        let lane = Args::parse_from(["gpu-sim"]).sim_config();
        assert_eq!(
            lane,
            SimConfig::default(),
            "the lane model stays the default"
        );
    }
}
