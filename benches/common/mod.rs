//! What only the benchmarks need: simulated GPUs served in this process, and the numbers.
//! Starting prefixlb, free ports and mock servers come from the tests' support module.

#![allow(dead_code)]

#[path = "../../tests/common/mod.rs"]
mod support;

pub mod peers;
pub mod spread;
pub mod tls;

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
pub use support::*;

/// Simulated GPUs on a runtime of their own, as a separate process would have; stopped when
/// dropped.
pub struct Sims {
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Sims {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// `n` simulated GPUs, with gpu-sim's command-line `args` for the model.
pub async fn start_sims(n: usize, args: &[String]) -> (Sims, Vec<SocketAddr>) {
    // Ports only looked up free: the kernel may hand the same one out twice in a row.
    let mut addrs: Vec<SocketAddr> = Vec::with_capacity(n);
    while addrs.len() < n {
        let a = free_addr();
        if !addrs.contains(&a) {
            addrs.push(a);
        }
    }
    let mut argv = vec!["gpu-sim".to_owned()];
    for a in &addrs {
        argv.extend(["--listen".to_owned(), a.to_string()]);
    }
    argv.extend_from_slice(args);
    let args = gpu_sim::cli::Args::parse_from(argv);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.spawn(async move {
        if let Err(e) = gpu_sim::cli::serve(args).await {
            eprintln!("gpu-sim: {e}");
        }
    });
    for a in &addrs {
        wait_listening(*a, "gpu-sim").await;
    }
    (
        Sims {
            runtime: Some(runtime),
        },
        addrs,
    )
}

pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

pub fn out_dir() -> PathBuf {
    let dir = std::env::var_os("BENCH_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/bench-results"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
