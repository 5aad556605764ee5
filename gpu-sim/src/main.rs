//! `gpu-sim`: simulated OpenAI-compatible inference servers, one per `--listen` address, each
//! its own GPU (prefix cache, prefill lane, decode batch). See the `gpu_sim` library for the
//! model.

use clap::Parser;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    gpu_sim::cli::serve(gpu_sim::cli::Args::parse()).await
}
