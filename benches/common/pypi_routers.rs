//! The routers installed from PyPI (Rust routers in Python wheels, each run in its own Python
//! process), in virtual environments beside the build: vllm-router, sglang-router and SMG.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::super::support::{binary, free_addr};
use super::{spawn_pinned, Killed};

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
    start_python_router(vllm_router()?, workers, policy, false).await
}

fn vllm_router() -> Result<Command, String> {
    let mut command = Command::new(python_routers()?.join("vllm-router"));
    // Its log level flag does not reach every line; RUST_LOG does.
    command.env("RUST_LOG", "error");
    Ok(command)
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
    start_python_router(command, workers, policy, false).await
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
    let mut command = smg()?;
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
        command.args(NO_LOADS);
    }
    // The simulator serves no tokenizer: SMG routes on the raw text, as it does over HTTP.
    command.arg(NO_TOKENIZER);
    if let Some(header) = sticky_header {
        command.args(["--routing-key-override", "--routing-key-headers", header]);
    }
    start_python_router(command, workers, policy, false).await
}

/// SMG's flags for workers that serve no `/v1/loads`: no load polling, and no overload
/// protection, which reads only that page.
const NO_LOADS: [&str; 2] = [
    "--disable-load-monitoring",
    "--disable-worker-overload-protection",
];
/// SMG's flag for workers with no tokenizer to fetch.
const NO_TOKENIZER: &str = "--disable-tokenizer-autoload";

fn smg() -> Result<Command, String> {
    let mut command = Command::new(venv("smg-venv", &SMG, &["smg"])?.join("smg"));
    command.arg("launch");
    Ok(command)
}

/// SMG 1.13 in front of the overhead and memory benches' one trivial upstream, on the server
/// CPU when `pinned`, with `args` beside; once it is ready. Its policy is `cache_aware`, the one
/// its users run for prefix reuse (and issue 31 measured), at its defaults: with one worker its
/// balance thresholds never come into play, but its radix tree is kept for every request. The
/// upstream is no engine: it serves no `/v1/loads`, so load monitoring and the overload
/// protection that reads only that page are off (`--disable-load-monitoring` help), and it has
/// no tokenizer to fetch (`--disable-tokenizer-autoload`: SMG routes on the raw text, as it
/// does over HTTP). SMG's own request log stays at `error`, as for every router started here.
pub async fn start_smg_in_front(
    upstream: SocketAddr,
    pinned: bool,
    args: &[&str],
) -> Result<(SocketAddr, Killed), String> {
    let mut command = smg()?;
    command.args(NO_LOADS).arg(NO_TOKENIZER).args(args);
    start_python_router(command, &[upstream], "cache_aware", pinned).await
}

/// vllm-router 0.1.17 in front of the overhead and memory benches' one trivial upstream, on the
/// server CPU when `pinned`; once it is ready. Its policy is `consistent_hash`, as issue 31
/// measured it (the cluster bench's prefix-affine vllm-router row), at its defaults: 160
/// virtual nodes, 32,768 requests in flight before it queues, more than these benches hold.
/// These requests carry no session header, so all hash alike: with one worker, no matter.
pub async fn start_vllm_router_in_front(
    upstream: SocketAddr,
    pinned: bool,
) -> Result<(SocketAddr, Killed), String> {
    start_python_router(vllm_router()?, &[upstream], "consistent_hash", pinned).await
}

/// The router `command` with `policy` in front of `workers`, on the server CPU when `pinned`;
/// once it says it is ready.
async fn start_python_router(
    mut command: Command,
    workers: &[SocketAddr],
    policy: &str,
    pinned: bool,
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
    let mut child = spawn_pinned(&mut command, pinned);
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
