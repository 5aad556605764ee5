//! The simulated GPUs, each a `gpu-sim` process of its own: a SIGKILL then drops its sockets
//! as a crashed engine's are dropped, and it comes back on the same port.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};

use crate::common::binary;

pub const MODEL: &str = "sim-llama-3-8b";

pub struct Engines {
    bin: PathBuf,
    logs: PathBuf,
    pub addrs: Vec<SocketAddr>,
    children: Vec<Option<Child>>,
}

impl Engines {
    /// `n` engines, each up and listening.
    pub async fn start(n: usize, logs: &Path) -> Result<Self, String> {
        let mut engines = Self {
            bin: gpu_sim_binary()?,
            logs: logs.to_owned(),
            addrs: ports(n)?,
            children: (0..n).map(|_| None).collect(),
        };
        for i in 0..n {
            engines.restart(i).await?;
        }
        Ok(engines)
    }

    pub fn name(&self, i: usize) -> String {
        self.addrs[i].to_string()
    }

    /// SIGKILL, and the process reaped.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.children[i].take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts engine `i` on its port and waits until it listens. The port may still be held
    /// for a moment after a kill: a start that exits is tried again.
    pub async fn restart(&mut self, i: usize) -> Result<(), String> {
        let addr = self.addrs[i];
        let mut last = String::new();
        for _ in 0..10 {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.logs.join(format!("engine-{i}.log")))
                .map_err(|e| e.to_string())?;
            let mut child = Command::new(&self.bin)
                .args(["--listen", &addr.to_string(), "--model", MODEL])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .map_err(|e| format!("{}: {e}", self.bin.display()))?;
            let start = Instant::now();
            loop {
                if let Ok(Some(status)) = child.try_wait() {
                    last = format!("gpu-sim on {addr} exited at start ({status})");
                    break;
                }
                if tokio::net::TcpStream::connect(addr).await.is_ok() {
                    self.children[i] = Some(child);
                    return Ok(());
                }
                if start.elapsed() > Duration::from_secs(10) {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("gpu-sim not listening on {addr} after 10 s"));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Err(last)
    }

    pub fn up(&self) -> usize {
        self.children.iter().flatten().count()
    }
}

impl Drop for Engines {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            self.kill(i);
        }
    }
}

/// `n` loopback ports below the kernel's ephemeral range. A killed engine's port is free for
/// seconds; prefixlb's own outgoing connections take their local ports from that range, and
/// one of them holding the port would keep the engine from coming back.
fn ports(n: usize) -> Result<Vec<SocketAddr>, String> {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let from = low.saturating_sub(12_000).max(1024);
    let mut rng = rand::rngs::StdRng::from_os_rng();
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for _ in 0..1000 {
        if addrs.len() == n {
            return Ok(addrs);
        }
        let addr = SocketAddr::from(([127, 0, 0, 1], rng.random_range(from..low)));
        if !addrs.contains(&addr) && TcpListener::bind(addr).is_ok() {
            addrs.push(addr);
        }
    }
    Err(format!("no {n} free ports in {from}..{low}"))
}

/// The workspace's `gpu-sim` binary in release, built beside prefixlb (a no-op when it is up
/// to date): a bench is not given the binaries of other packages.
fn gpu_sim_binary() -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--release", "-p", "gpu-sim", "--bin", "gpu-sim"])
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !status.success() {
        return Err("cargo build --release -p gpu-sim failed".into());
    }
    let bin = binary()
        .parent()
        .map(|dir| dir.join("gpu-sim"))
        .ok_or("no target directory")?;
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!("{} was not built", bin.display()))
    }
}
