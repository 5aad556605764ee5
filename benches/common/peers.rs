//! The processes a benchmark compares against, started as a user would run them: HAProxy (the
//! Debian package, installed when missing and root), the bare Pingora proxy of
//! `examples/bare_proxy.rs`, and the routers installed from PyPI (`pypi_routers.rs`); each can
//! be pinned to the server CPU.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::support::{binary, free_addr};

#[path = "pypi_routers.rs"]
mod pypi_routers;
// Not every bench that includes this module starts one of them.
#[allow(unused_imports)]
pub use pypi_routers::*;

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

/// `examples/bare_proxy`, built in release beside this bench every time (cargo does nothing when
/// it is up to date), so that the floor is never an older build than prefixlb.
fn bare_proxy() -> Result<PathBuf, String> {
    let profile_dir = binary()
        .parent()
        .map(Path::to_path_buf)
        .ok_or("no target directory")?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "--release", "--example", "bare_proxy"])
        .status()
        .map_err(|e| format!("cargo: {e}"))?;
    if !status.success() {
        return Err("cargo build --release --example bare_proxy failed".into());
    }
    Ok(profile_dir.join("examples").join("bare_proxy"))
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
