//! The whole thing on one machine, without a GPU: two simulated GPUs on 127.0.0.1:8001 and
//! :8002 (the peers of `conf/prefixlb.yaml`), prefixlb in front of them on that configuration,
//! and one streamed chat completion through it, printed as it comes. prefixlb then keeps
//! serving until Ctrl-C, for `curl` to try.
//!
//! `cargo run --release --example demo` (or `sh examples/demo.sh` on a fresh machine).

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use futures_util::StreamExt;

const GPUS: [&str; 2] = ["127.0.0.1:8001", "127.0.0.1:8002"];
const PROXY: &str = "127.0.0.1:8080";

fn main() -> ExitCode {
    let mut argv = vec!["gpu-sim".to_owned()];
    for gpu in GPUS {
        argv.extend(["--listen".to_owned(), gpu.to_owned()]);
    }
    let sims = gpu_sim::cli::Args::parse_from(argv);
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().expect("a runtime for the simulated GPUs");
        runtime.block_on(async move {
            if let Err(e) = gpu_sim::cli::serve(sims).await {
                eprintln!("demo: the simulated GPUs stopped: {e}");
            }
        });
    });
    std::thread::spawn(|| {
        let runtime = tokio::runtime::Runtime::new().expect("a runtime for the client");
        if let Err(e) = runtime.block_on(ask()) {
            eprintln!("demo: {e}");
        }
    });
    prefixlb::server::main_from([
        "prefixlb",
        "-l",
        "conf/prefixlb.yaml",
        "-c",
        "conf/pingora.yaml",
    ])
}

/// Waits for prefixlb, then streams one answer through it.
async fn ask() -> Result<(), String> {
    let proxy: SocketAddr = PROXY.parse().map_err(|e| format!("{e}"))?;
    let start = Instant::now();
    while tokio::net::TcpStream::connect(proxy).await.is_err() {
        if start.elapsed() > Duration::from_secs(30) {
            return Err(format!("prefixlb did not start listening on {proxy}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let body = serde_json::json!({
        "model": "m",
        "stream": true,
        "max_tokens": 24,
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hello through the load balancer."}
        ]
    });
    let answer = reqwest::Client::new()
        .post(format!("http://{proxy}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let gpu = answer
        .headers()
        .get("x-upstream")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("a simulated GPU")
        .to_owned();
    println!(
        "\n--- a streamed answer through prefixlb ({}):",
        answer.status()
    );
    let mut stream = answer.bytes_stream();
    let mut out = std::io::stdout();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        for line in String::from_utf8_lossy(&chunk).lines() {
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            let token = serde_json::from_str::<serde_json::Value>(data)
                .ok()
                .and_then(|v| {
                    v["choices"][0]["delta"]["content"]
                        .as_str()
                        .map(str::to_owned)
                });
            if let Some(token) = token {
                let _ = write!(out, "{token}");
                let _ = out.flush();
            }
        }
    }
    println!("\n--- served by {gpu}. prefixlb keeps running; try:");
    println!("curl -N localhost:8080/v1/chat/completions -d '{{\"model\":\"m\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'");
    println!("curl localhost:9090/admin/peers");
    println!("Ctrl-C stops it.\n");
    Ok(())
}
