//! The processes a benchmark compares against, started as a user would run them: HAProxy (the
//! Debian package, installed when missing and root), the bare Pingora proxy of
//! `examples/bare_proxy.rs`; each can be pinned to the server CPU.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::support::{binary, free_addr};

/// The CPU the load generator runs on; the proxies and upstreams run on [`SERVER_CPU`].
pub const LOAD_CPU: usize = 0;
pub const SERVER_CPU: usize = 1;

/// Whether there are two CPUs to pin load and server apart.
pub fn can_pin() -> bool {
    std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2)
}

/// A child process, killed when dropped, and the files it needs while it runs.
pub struct Killed {
    pub child: Child,
    _files: Option<tempfile::TempDir>,
}

impl Killed {
    /// Waits until the process accepts connections on `addr`; an error if it exits first.
    pub async fn serving(&mut self, addr: SocketAddr) -> Result<(), String> {
        let start = Instant::now();
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!("exited at start ({status})"));
            }
            if start.elapsed() > Duration::from_secs(20) {
                return Err(format!("not listening on {addr} after 20 s"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn spawn_pinned(command: &mut Command, pinned: bool) -> Killed {
    pin_command(command, pinned);
    Killed {
        child: command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("a child process"),
        _files: None,
    }
}

/// Runs the command's process, and every thread it starts, on the server CPU.
pub fn pin_command(command: &mut Command, pinned: bool) {
    if pinned {
        // SAFETY: between fork and exec only sched_setaffinity runs, which is async-signal-safe.
        unsafe {
            command.pre_exec(|| {
                pin(SERVER_CPU);
                Ok(())
            });
        }
    }
}

pub fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes within it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// User and system CPU time of a process so far.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name may hold spaces: fields are counted after its closing parenthesis.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = after
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Duration::from_secs_f64(fields.iter().sum::<u64>() as f64 / ticks)
}

/// Resident memory of a process now.
pub fn rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// HAProxy in front of `upstreams`, spreading by `balance` (`roundrobin`, `leastconn`).
pub async fn start_haproxy(
    upstreams: &[SocketAddr],
    balance: &str,
    pinned: bool,
    maxconn: usize,
    bind_options: &str,
) -> Result<(SocketAddr, Killed), String> {
    let backend = format!("  balance {balance}\n");
    start_haproxy_with(upstreams, &backend, pinned, maxconn, bind_options).await
}

/// HAProxy in front of `upstreams`, its backend spreading as the `backend` lines say.
pub async fn start_haproxy_with(
    upstreams: &[SocketAddr],
    backend: &str,
    pinned: bool,
    maxconn: usize,
    bind_options: &str,
) -> Result<(SocketAddr, Killed), String> {
    let haproxy = find_or_install("haproxy", "haproxy")?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let addr = free_addr();
    let servers: String = upstreams
        .iter()
        .enumerate()
        .map(|(i, u)| format!("  server e{i} {u}\n"))
        .collect();
    let config = format!(
        "global\n  nbthread 1\n  maxconn {maxconn}\ndefaults\n  mode http\n  timeout connect 3s\n  timeout client 120s\n  timeout server 120s\n  http-reuse always\nfrontend lb\n  bind {addr} {bind_options}\n  default_backend engines\nbackend engines\n{backend}{servers}"
    );
    let path = dir.path().join("haproxy.cfg");
    std::fs::write(&path, config).map_err(|e| e.to_string())?;
    let mut child = spawn_pinned(Command::new(haproxy).arg("-f").arg(&path), pinned);
    child._files = Some(dir);
    child.serving(addr).await?;
    Ok((addr, child))
}

pub async fn start_bare(
    upstream: SocketAddr,
    pinned: bool,
) -> Result<(SocketAddr, Killed), String> {
    let binary = bare_proxy()?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let conf = dir.path().join("pingora.yaml");
    std::fs::write(
        &conf,
        format!(
            "version: 1\nthreads: 1\npid_file: {d}/p.pid\nupgrade_sock: {d}/u.sock\n",
            d = dir.path().display()
        ),
    )
    .map_err(|e| e.to_string())?;
    let addr = free_addr();
    let mut child = spawn_pinned(
        Command::new(binary)
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--upstream")
            .arg(upstream.to_string())
            .arg("-c")
            .arg(&conf),
        pinned,
    );
    child._files = Some(dir);
    child.serving(addr).await?;
    Ok((addr, child))
}

/// `examples/bare_proxy`, built in release beside this bench when it is not there yet.
fn bare_proxy() -> Result<PathBuf, String> {
    let profile_dir = binary()
        .parent()
        .map(Path::to_path_buf)
        .ok_or("no target directory")?;
    let example = profile_dir.join("examples").join("bare_proxy");
    if !example.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--release", "--example", "bare_proxy"])
            .status()
            .map_err(|e| format!("cargo: {e}"))?;
        if !status.success() {
            return Err("cargo build --example bare_proxy failed".into());
        }
    }
    Ok(example)
}

/// The program `name`, installed from the Debian package `package` when it is missing and this
/// process may install packages.
fn find_or_install(name: &str, package: &str) -> Result<PathBuf, String> {
    let found = || {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        })
    };
    if let Some(path) = found() {
        return Ok(path);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(format!(
            "{name} is not installed, and installing it needs root"
        ));
    }
    println!("installing {package} (apt-get)...");
    let apt = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !apt(&["install", "-y", "-qq", package]) {
        apt(&["update", "-qq"]);
        apt(&["install", "-y", "-qq", package]);
    }
    found().ok_or_else(|| format!("{name} could not be installed with apt-get"))
}

/// The routers installed from PyPI, pinned to the versions compared.
const PYTHON_ROUTERS: [&str; 2] = ["vllm-router==0.1.17", "sglang-router==0.3.2"];
/// SMG, the successor of sglang-router, in a venv of its own: it pins dependencies of its own.
const SMG: [&str; 1] = ["smg==1.13.0"];

/// The `bin` directory of the virtual environment `name` beside the build, holding
/// `packages` once `programs` are there; created and filled with pip on first use.
fn venv(name: &str, packages: &[&str], programs: &[&str]) -> Result<PathBuf, String> {
    let venv = binary()
        .parent()
        .and_then(Path::parent)
        .map(|target| target.join(name))
        .ok_or("no target directory")?;
    let bin = venv.join("bin");
    if programs.iter().all(|p| bin.join(p).is_file()) {
        return Ok(bin);
    }
    println!(
        "installing {} into {} (pip)...",
        packages.join(", "),
        venv.display()
    );
    let quiet = |c: &mut Command| c.stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    if !quiet(Command::new("python3").args(["-m", "venv"]).arg(&venv)) {
        return Err("python3 -m venv failed (is python3-venv installed?)".into());
    }
    if !quiet(
        Command::new(bin.join("pip"))
            .args(["install", "-q", "--disable-pip-version-check"])
            .args(packages),
    ) {
        return Err(format!("pip could not install {}", packages.join(", ")));
    }
    Ok(bin)
}

fn python_routers() -> Result<PathBuf, String> {
    venv(
        "bench-venv",
        &PYTHON_ROUTERS,
        &["vllm-router", "sglang-router"],
    )
}

/// vllm-router with `policy` in front of `workers`, once it says it is ready.
pub async fn start_vllm_router(
    workers: &[SocketAddr],
    policy: &str,
) -> Result<(SocketAddr, Killed), String> {
    let mut command = Command::new(python_routers()?.join("vllm-router"));
    // Its log level flag does not reach every line; RUST_LOG does.
    command.env("RUST_LOG", "error");
    start_python_router(command, workers, policy).await
}

/// A cache-aware router's spill gate scaled to GPUs of `slots` running requests: it leaves a
/// request's cached GPU for the least loaded one when that GPU holds more than a full batch
/// (`slots`) beyond the least loaded (sglang-router) or the fleet's mean (SMG), and 1.5 times
/// as many. The default absolute threshold, 64 requests, is eight full batches on these GPUs:
/// never reached before the hot GPU has queued far past its peers. SMG's docs advise lower
/// thresholds for bursty traffic (docs/concepts/routing/cache-aware.md, "Balance Thresholds",
/// which sglang-router shares: its `--balance-abs-threshold` help gives the same rule); the
/// relative one stays at its documented 1.5.
fn balance_thresholds(slots: usize) -> [String; 4] {
    [
        "--balance-abs-threshold".into(),
        slots.to_string(),
        "--balance-rel-threshold".into(),
        "1.5".into(),
    ]
}

/// sglang-router with `policy` in front of `workers` of `slots` running requests each, once
/// it says it is ready.
pub async fn start_sglang_router(
    workers: &[SocketAddr],
    policy: &str,
    slots: usize,
) -> Result<(SocketAddr, Killed), String> {
    let mut command = Command::new(python_routers()?.join("python"));
    command.args(["-m", "sglang_router.launch_router"]);
    command.args(balance_thresholds(slots));
    start_python_router(command, workers, policy).await
}

/// SMG 1.13 with `policy` in front of `workers` of `slots` running requests each, keeping a
/// session on its worker by `sticky_header` when given; once it says it is ready. `loads`:
/// whether the workers serve SGLang's `/v1/loads`.
pub async fn start_smg(
    workers: &[SocketAddr],
    policy: &str,
    slots: usize,
    sticky_header: Option<&str>,
    loads: bool,
) -> Result<(SocketAddr, Killed), String> {
    let mut command = Command::new(venv("smg-venv", &SMG, &["smg"])?.join("smg"));
    command.arg("launch");
    command.args(balance_thresholds(slots));
    // prefix_hash's own gate: a worker this many requests over the mean (default 10, more
    // than a GPU's whole batch here) and 1.25 times it is walked past on the ring; scaled
    // to the slots as above (`--prefix-hash-balance-abs-threshold` help).
    command.args(["--prefix-hash-balance-abs-threshold", &slots.to_string()]);
    if loads {
        // It polls each SGLang engine's `/v1/loads` (running, waiting, `token_usage`) for its
        // overload protection (on by default: 8 waiting or 0.8 of the KV pool, a full batch
        // here, kept) and its load-aware choices; every 10 s by default, longer than a turn
        // of these runs, so every second.
        command.args(["--load-monitor-interval", "1"]);
    } else {
        // Engines without `/v1/loads` (llama.cpp): nothing to poll, and overload protection,
        // which reads only that page, switched off rather than fed nothing; SMG then balances
        // on the requests it has in flight itself (`--disable-load-monitoring` help).
        command.args([
            "--disable-load-monitoring",
            "--disable-worker-overload-protection",
        ]);
    }
    command
        // The simulator serves no tokenizer: SMG routes on the raw text, as it does over HTTP.
        .arg("--disable-tokenizer-autoload");
    if let Some(header) = sticky_header {
        command.args(["--routing-key-override", "--routing-key-headers", header]);
    }
    start_python_router(command, workers, policy).await
}

async fn start_python_router(
    mut command: Command,
    workers: &[SocketAddr],
    policy: &str,
) -> Result<(SocketAddr, Killed), String> {
    let (addr, metrics) = (free_addr(), free_addr());
    command
        .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
        .args(["--prometheus-host", "127.0.0.1"])
        .args(["--prometheus-port", &metrics.port().to_string()])
        .args(["--policy", policy, "--log-level", "error"])
        // It checks its workers every 30 s at start by default.
        .args(["--worker-startup-check-interval", "1"])
        .arg("--worker-urls")
        .args(workers.iter().map(|w| format!("http://{w}")));
    let mut child = spawn_pinned(&mut command, false);
    // The port may open before the workers are registered: /readiness says when they are.
    let client = reqwest::Client::new();
    let start = Instant::now();
    loop {
        let ready = client
            .get(format!("http://{addr}/readiness"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            return Ok((addr, child));
        }
        if let Ok(Some(status)) = child.child.try_wait() {
            return Err(format!("exited at start ({status})"));
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(format!("not ready on {addr} after 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
