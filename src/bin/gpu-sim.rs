//! `gpu-sim`: simulated OpenAI-compatible inference servers, one per `--listen` address, each
//! its own GPU (prefix cache, prefill lane, decode batch). See `prefixlb::sim` for the model.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::serve::ListenerExt;
use clap::Parser;
use prefixlb::sim::{server, Gpu, SimConfig};

#[derive(Parser, Debug)]
#[command(
    name = "gpu-sim",
    version,
    about = "Simulated LLM inference servers for prefixlb's demo and benchmarks"
)]
struct Cli {
    /// An address to serve one simulated GPU on; repeat for more GPUs.
    #[arg(long = "listen", default_values = ["127.0.0.1:8001", "127.0.0.1:8002"])]
    listen: Vec<SocketAddr>,
    /// The model name `/v1/models` reports.
    #[arg(long, default_value = "sim-llama-3-8b")]
    model: String,
    /// Prefix-cache capacity, in tokens.
    #[arg(long, default_value_t = SimConfig::default().cache_tokens)]
    cache_tokens: usize,
    #[arg(long, default_value_t = SimConfig::default().prefill_tokens_per_sec)]
    prefill_tokens_per_sec: f64,
    #[arg(long, default_value_t = SimConfig::default().decode_ms_per_token)]
    decode_ms_per_token: f64,
    /// Extra decode time per token for each other running request, as a fraction.
    #[arg(long, default_value_t = SimConfig::default().batch_slowdown)]
    batch_slowdown: f64,
    /// Requests running at once; more wait.
    #[arg(long, default_value_t = SimConfig::default().max_running)]
    max_running: usize,
    /// Output tokens when a request names no `max_tokens`.
    #[arg(long, default_value_t = SimConfig::default().default_max_tokens)]
    max_tokens: usize,
    /// Divides every duration: 10 runs ten times faster, ratios unchanged.
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let config = SimConfig {
        cache_tokens: cli.cache_tokens,
        prefill_tokens_per_sec: cli.prefill_tokens_per_sec,
        decode_ms_per_token: cli.decode_ms_per_token,
        batch_slowdown: cli.batch_slowdown,
        max_running: cli.max_running,
        default_max_tokens: cli.max_tokens,
        speed: cli.speed,
        ..SimConfig::default()
    };
    let mut servers = Vec::new();
    for addr in cli.listen {
        // Each token is a small write: without TCP_NODELAY, Nagle's algorithm would hold one
        // back until the previous is acknowledged, adding tens of milliseconds.
        let listener = tokio::net::TcpListener::bind(addr).await?.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let app = server::router(
            Arc::new(Gpu::new(config.clone())),
            addr.to_string(),
            cli.model.clone(),
        )?;
        eprintln!("gpu-sim: {} serving {addr}", cli.model);
        servers.push(tokio::spawn(
            async move { axum::serve(listener, app).await },
        ));
    }
    for s in servers {
        s.await??;
    }
    Ok(())
}
