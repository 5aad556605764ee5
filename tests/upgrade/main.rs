//! Zero-downtime binary upgrades, 20 in a row, under continuous load from keep-alive clients and
//! from clients that open a connection per request, with SSE streams spanning the upgrades:
//! Pingora hands the listening sockets over, each old process finishes what it has, and exits
//! soon after its last stream; no client sees an error.

#[path = "../common/mod.rs"]
mod common;

mod late_quit;
mod replica_port;
mod systemd;
mod under_load;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::*;

/// A process of the test's, killed if the test ends before it exits.
pub(crate) struct Owned(Child);

impl std::ops::Deref for Owned {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Owned {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

pub(crate) fn spawn(dir: &Path, name: &str, upgrade: bool) -> Owned {
    let mut cmd = Command::new(binary());
    cmd.arg("-l")
        .arg(dir.join("prefixlb.yaml"))
        .arg("-c")
        .arg(dir.join("pingora.yaml"));
    if upgrade {
        cmd.arg("-u");
    }
    cmd.env("RUST_LOG", "info")
        .stdout(std::fs::File::create(dir.join(format!("{name}.access.log"))).unwrap())
        .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
        .spawn()
        .map(Owned)
        .unwrap()
}

/// Writes the configuration every generation shares (listening on `port`, a JSON access log,
/// `lb` added, and a long grace period: every old process must end long before it, when its
/// work is done), and starts the first generation, "p0".
pub(crate) async fn start_first(dir: &Path, port: u16, lb: TestConfig) -> Owned {
    let lb = lb.listen_on(loopback(port)).access_log("json");
    std::fs::write(dir.join("prefixlb.yaml"), lb.to_yaml()).unwrap();
    let pingora = PingoraConfig::new()
        .threads(2)
        .pid_file(&dir.join("prefixlb.pid"))
        .upgrade_sock(&dir.join("upgrade.sock"))
        .grace_seconds(60, 5);
    std::fs::write(dir.join("pingora.yaml"), pingora.to_yaml()).unwrap();
    let first = spawn(dir, "p0", false);
    wait_listening(format!("127.0.0.1:{port}").parse().unwrap(), "prefixlb").await;
    first
}

/// Waits until generation `name` has the listening sockets, as its log says.
pub(crate) async fn took_over(dir: &Path, name: &str) {
    let log = dir.join(format!("{name}.log"));
    let start = Instant::now();
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("Bootstrap done")
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{name} got no sockets"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
