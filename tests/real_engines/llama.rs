//! Real `llama-server` engines for the tests (and the benches): made by
//! `tests/real_engines/setup.sh` (in `$PREFIXLB_LLAMA_DIR`, or else in
//! `${PREFIXLB_CACHE:-$HOME/.cache/prefixlb}/llama-server-11434`) the first time a test asks,
//! started on loopback ports, killed when dropped. A set-up that cannot be made fails the test:
//! a test that passes without its engine proves nothing.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The name the engines serve their model under (`--alias`).
pub const MODEL: &str = "tiny-llama";

/// Where `tests/real_engines/setup.sh` put the server, the model and the Python venv.
pub struct Setup {
    dir: PathBuf,
}

impl Setup {
    /// The set-up, made by `setup.sh` when it is not there yet: the first test on a machine
    /// builds llama-server (about ten minutes on two cores; the script locks, so the tests of
    /// one run wait for one build), every later one finds it at once.
    pub fn find() -> Self {
        static DIR: OnceLock<PathBuf> = OnceLock::new();
        let dir = DIR.get_or_init(|| {
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/real_engines/setup.sh");
            let out = Command::new("bash")
                .arg(&script)
                .stderr(Stdio::inherit())
                .output()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
            assert!(
                out.status.success(),
                "{} failed ({}): the real-engine tests need llama.cpp's llama-server and a tiny \
                 model; its output above says what went wrong",
                script.display(),
                out.status
            );
            let printed = String::from_utf8_lossy(&out.stdout);
            PathBuf::from(printed.lines().last().unwrap_or_default().trim())
        });
        let setup = Self { dir: dir.clone() };
        for needed in [setup.server(), setup.model(), setup.python()] {
            assert!(
                needed.exists(),
                "{} is missing after set-up",
                needed.display()
            );
        }
        setup
    }

    pub fn server(&self) -> PathBuf {
        self.dir.join("bin/llama-server")
    }

    pub fn model(&self) -> PathBuf {
        self.dir.join("tiny-llama.gguf")
    }

    /// The venv's Python, which has the `openai` package.
    pub fn python(&self) -> PathBuf {
        self.dir.join("venv/bin/python")
    }

    /// Starts `n` engines, one after another (each loads the model in a fraction of a second).
    pub async fn engines(&self, n: usize, log_dir: &Path) -> Vec<Engine> {
        let mut engines = Vec::with_capacity(n);
        for i in 0..n {
            engines.push(Engine::start(self, &log_dir.join(format!("engine-{i}.log"))).await);
        }
        engines
    }
}

/// One `llama-server`: one thread, two slots of 4,096 tokens each, greedy sampling (answers do
/// not vary from run to run), its Prometheus page on.
pub struct Engine {
    child: Child,
    pub addr: SocketAddr,
    log: PathBuf,
    /// How long it took to answer `/health` with 200.
    pub started_in: Duration,
}

impl Engine {
    async fn start(setup: &Setup, log: &Path) -> Self {
        // The port is only looked up free: another process may take it first, and then the
        // engine exits at once; then again, on another.
        for _ in 0..3 {
            let mut engine = Self::spawn(setup, log);
            if engine.came_up().await {
                return engine;
            }
        }
        panic!("llama-server did not start; its log:\n{}", read(log));
    }

    fn spawn(setup: &Setup, log: &Path) -> Self {
        let addr = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap();
        let out = std::fs::File::create(log).unwrap();
        let mut command = Command::new(setup.server());
        command
            .arg("-m")
            .arg(setup.model())
            .args(["--alias", MODEL, "--host", "127.0.0.1", "--port"])
            .arg(addr.port().to_string())
            .args([
                "-t",
                "1",
                "-c",
                "8192",
                "-np",
                "2",
                "--metrics",
                "--temp",
                "0",
            ])
            .args(extra_args())
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        // Should the test process die without unwinding (a signal, an abort), the engine goes
        // with it rather than living on as an orphan holding its port and 300 MB. The signal
        // comes when the spawning thread ends: a test's own thread, which outlives its engines
        // (a runtime's worker thread might not).
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Self {
            child: command.spawn().expect("llama-server runs"),
            addr,
            log: log.to_owned(),
            started_in: Duration::ZERO,
        }
    }

    /// Waits (at most 30 s) until `/health` answers 200 (503 while the model loads); false
    /// when the engine exited first.
    async fn came_up(&mut self) -> bool {
        let start = Instant::now();
        let client = reqwest::Client::new();
        while start.elapsed() < Duration::from_secs(30) {
            if self.child.try_wait().unwrap().is_some() {
                return false;
            }
            let health = client
                .get(self.url("/health"))
                .timeout(Duration::from_secs(1))
                .send()
                .await;
            if health.is_ok_and(|r| r.status() == 200) {
                self.started_in = start.elapsed();
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("llama-server not healthy within 30 s: {}", read(&self.log));
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn addr_str(&self) -> String {
        self.addr.to_string()
    }

    /// Its Prometheus page.
    pub async fn metrics(&self) -> String {
        reqwest::get(self.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Kills it at once (SIGKILL), as a crash would, and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Arguments added to every `llama-server` from `BENCH_LLAMA_ARGS` (split at whitespace), so
/// that the engines bench can run the engines as an operator might set them up (the tests
/// never set it).
pub fn extra_args() -> Vec<String> {
    std::env::var("BENCH_LLAMA_ARGS")
        .map(|a| a.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}
