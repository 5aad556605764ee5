//! Processes for the cluster benchmarks: gpu-sim and prefixlb, built by cargo for this bench,
//! on free loopback ports, killed when dropped.

#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Proc {
    child: Child,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

async fn wait_listening(addr: SocketAddr, what: &str) {
    let start = Instant::now();
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what} did not start on {addr}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `n` simulated GPUs in one gpu-sim process, with `args` for the model.
pub async fn start_sims(n: usize, args: &[String]) -> (Proc, Vec<SocketAddr>) {
    let addrs: Vec<SocketAddr> = (0..n).map(|_| free_addr()).collect();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpu-sim"));
    for a in &addrs {
        cmd.arg("--listen").arg(a.to_string());
    }
    let child = cmd.args(args).stderr(Stdio::null()).spawn().unwrap();
    for a in &addrs {
        wait_listening(*a, "gpu-sim").await;
    }
    (Proc { child, _dir: None }, addrs)
}

/// prefixlb in front of `peers`, with `extra` YAML (routing, queue, ...) appended.
pub async fn start_lb(
    peers: &[SocketAddr],
    max_in_flight: Option<u32>,
    extra: &str,
) -> (Proc, SocketAddr, SocketAddr) {
    let dir = tempfile::tempdir().unwrap();
    let (addr, admin) = (free_addr(), free_addr());
    // The access log stays on, as by default: its cost is part of what is measured.
    let mut yaml = format!("listen: [\"{addr}\"]\nadmin: {{listen: \"{admin}\"}}\npeers:\n");
    for p in peers {
        yaml.push_str(&format!("  - addr: \"{p}\"\n"));
        if let Some(m) = max_in_flight {
            yaml.push_str(&format!("    max_in_flight: {m}\n"));
        }
    }
    yaml.push_str(extra);
    let lb = dir.path().join("prefixlb.yaml");
    std::fs::write(&lb, yaml).unwrap();
    let pingora = dir.path().join("pingora.yaml");
    std::fs::write(
        &pingora,
        format!(
            "version: 1\nthreads: 2\npid_file: {d}/p.pid\nupgrade_sock: {d}/u.sock\n",
            d = dir.path().display()
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_prefixlb"))
        .arg("-l")
        .arg(&lb)
        .arg("-c")
        .arg(&pingora)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(out_dir().join("prefixlb.stderr")).unwrap())
        .spawn()
        .unwrap();
    wait_listening(addr, "prefixlb").await;
    wait_listening(admin, "prefixlb admin").await;
    (
        Proc {
            child,
            _dir: Some(dir),
        },
        addr,
        admin,
    )
}

/// The value of an unlabelled sample in Prometheus text.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
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
