//! The real `prefixlb` binary on ephemeral loopback ports: its two files written, the process
//! spawned and waited for, its admin API and logs read, signals sent, its exit awaited.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use super::{free_port, PingoraConfig, TestConfig};

/// The real `prefixlb` binary, on its own ports, killed when dropped.
pub struct Proxy {
    child: Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub dir: tempfile::TempDir,
}

impl Proxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn peers(&self) -> serde_json::Value {
        self.admin_get("/admin/peers").await.json().await.unwrap()
    }

    /// A GET of the admin API. When it cannot be reached, the failure says what the proxy
    /// logged last: a crash, an exit or a port taken away tell apart only there.
    async fn admin_get(&self, path: &str) -> reqwest::Response {
        match reqwest::get(format!("http://{}{path}", self.admin)).await {
            Ok(response) => response,
            Err(e) => {
                let log = self.log();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                panic!(
                    "GET {path} from the proxy's admin API: {e}\nits log ends:\n{}",
                    tail.join("\n")
                )
            }
        }
    }

    pub async fn in_flight_of(&self, addr: &str) -> u64 {
        let peers = self.peers().await;
        peers["peers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["address"] == addr)
            .map(|p| p["in_flight"].as_u64().unwrap())
            .unwrap()
    }

    /// Waits (at most `limit`) until nothing is in flight; returns the last listing. Idle means
    /// the total and every peer at 0: a listing reads each peer and then the total, so a slot
    /// released between the two reads shows on its peer and not in the total.
    pub async fn wait_idle(&self, limit: Duration) -> serde_json::Value {
        let start = Instant::now();
        loop {
            let peers = self.peers().await;
            let idle = peers["in_flight"] == 0
                && peers["peers"]
                    .as_array()
                    .is_some_and(|ps| ps.iter().all(|p| p["in_flight"] == 0));
            if idle || start.elapsed() > limit {
                return peers;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The path of the proxy's own configuration file.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("prefixlb.yaml")
    }

    /// Rewrites the proxy's configuration file as `config`, on the ports it has.
    pub fn rewrite_config(&self, config: &TestConfig) {
        std::fs::write(
            self.config_path(),
            proxy_file(config, self.addr, self.admin),
        )
        .unwrap();
    }

    /// What the proxy wrote to standard output: its access log.
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stdout.log")).unwrap_or_default()
    }

    /// The access log once `done` holds for it (its writer runs apart from the requests), or
    /// as it is after 5 s.
    pub async fn access_log_when(&self, done: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let log = self.access_log();
            if done(&log) || start.elapsed() > Duration::from_secs(5) {
                return log;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub async fn metrics(&self) -> String {
        self.admin_get("/metrics").await.text().await.unwrap()
    }

    /// Asserts that every slot is released within 5 s.
    pub async fn assert_idle(&self) {
        let listing = self.wait_idle(Duration::from_secs(5)).await;
        assert_eq!(listing["in_flight"], 0, "slots still held: {listing}");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default()
    }

    pub fn signal(&self, signal: &str) {
        send_signal(self.pid(), signal);
    }

    /// Waits for the proxy to exit by itself; see [`exits`].
    pub async fn exits(&mut self, limit: Duration) -> Instant {
        exits(&mut self.child, limit).await
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Waits until the proxy and its admin listener answer.
    pub async fn wait_ready(&mut self) {
        assert!(self.came_up().await, "proxy did not start: {}", self.log());
    }

    /// Waits until the proxy and its admin listener answer; false when it exited first, or
    /// when another process answers on its admin port. Its ports were only looked up free, and a
    /// parallel test may have bound one before this process did.
    async fn came_up(&mut self) -> bool {
        let start = Instant::now();
        loop {
            if self.child.try_wait().unwrap().is_some() {
                return false;
            }
            if let Ok(r) = reqwest::get(format!("http://{}/admin/peers", self.admin)).await {
                // Its own answer: the listing, or a refusal for want of the admin token.
                let ours = r.status() == 401
                    || r.json::<serde_json::Value>()
                        .await
                        .is_ok_and(|v| v["peers"].is_array());
                if !ours {
                    return false;
                }
                if tokio::net::TcpStream::connect(self.addr).await.is_ok() {
                    // What answers may be another test's listener, which took the port first.
                    return listens_on(self.child.id(), self.addr.port());
                }
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "proxy did not start: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether process `pid` holds the socket listening on `port` (IPv4): one of its descriptors
/// is the socket `/proc/net/tcp` lists in state LISTEN (`0A`) on that port.
fn listens_on(pid: u32, port: u16) -> bool {
    let sockets: std::collections::HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let inode = target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?;
            Some(inode.to_owned())
        })
        .collect();
    let local = format!(":{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .any(|f| f.len() > 9 && f[1].ends_with(&local) && f[3] == "0A" && sockets.contains(f[9]))
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The membership in a `/admin/peers` listing (address and weight, in its order), without
/// the live load that moves between two listings.
pub fn members(listing: serde_json::Value) -> Vec<(String, u64)> {
    listing["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["address"].as_str().unwrap().to_owned(),
                p["weight"].as_u64().unwrap(),
            )
        })
        .collect()
}

pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_prefixlb"))
}

/// Starts the proxy with `config` (its ports are the spawner's to set), and waits until it
/// answers.
pub async fn start_proxy(config: &TestConfig) -> Proxy {
    start_proxy_with(config, &PingoraConfig::new().grace_seconds(1, 1)).await
}

/// [`start_proxy`] with Pingora's settings `pingora`.
pub async fn start_proxy_with(config: &TestConfig, pingora: &PingoraConfig) -> Proxy {
    start_proxy_adjusted(config, pingora, |_| {}).await
}

/// [`start_proxy_with`], with `adjust` applied to the command (see [`spawn_proxy_adjusted`]).
pub async fn start_proxy_adjusted(
    config: &TestConfig,
    pingora: &PingoraConfig,
    adjust: impl Fn(&mut Command),
) -> Proxy {
    // On ports another test took in the meantime it fails to start: again, on others.
    for _ in 0..2 {
        let mut proxy = spawn_proxy_adjusted(config, pingora, &adjust);
        if proxy.came_up().await {
            return proxy;
        }
    }
    let mut proxy = spawn_proxy_adjusted(config, pingora, &adjust);
    proxy.wait_ready().await;
    proxy
}

/// Starts the proxy without waiting for it.
pub fn spawn_proxy(config: &TestConfig, pingora: &PingoraConfig) -> Proxy {
    spawn_proxy_adjusted(config, pingora, |_| {})
}

/// `config` as the proxy on `addr` with its admin API on `admin` reads it. Listeners the
/// configuration sets without an address serve on `addr`, and it serves there alone when it
/// sets none. Engine metrics are not read unless `config` sets them: a mock counts a stream
/// until its next event fails to go out, a moment after the proxy gave its slot back, and tests
/// count slots exactly.
fn proxy_file(config: &TestConfig, addr: SocketAddr, admin: SocketAddr) -> String {
    let mut config = config.clone().admin_on(admin);
    config = if config.has_listeners() {
        config.address_listeners(addr)
    } else {
        config.listen_on(addr)
    };
    if !config.has_engine_metrics() {
        config = config.engine_metrics(false);
    }
    config.to_yaml()
}

/// [`spawn_proxy`], with `adjust` applied to the command first. Pingora's `threads` is 2 unless
/// `pingora` sets it.
pub fn spawn_proxy_adjusted(
    config: &TestConfig,
    pingora: &PingoraConfig,
    adjust: impl FnOnce(&mut Command),
) -> Proxy {
    let dir = tempfile::tempdir().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let admin: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let lb_path = dir.path().join("prefixlb.yaml");
    std::fs::write(&lb_path, proxy_file(config, addr, admin)).unwrap();
    let mut pingora = pingora
        .clone()
        .pid_file(&dir.path().join("p.pid"))
        .upgrade_sock(&dir.path().join("u.sock"));
    if !pingora.has_threads() {
        pingora = pingora.threads(2);
    }
    let pingora_path = dir.path().join("pingora.yaml");
    std::fs::write(&pingora_path, pingora.to_yaml()).unwrap();
    let mut command = Command::new(binary());
    command.env(
        "RUST_LOG",
        std::env::var("PREFIXLB_TEST_LOG").unwrap_or_else(|_| "info".into()),
    );
    // After the log level, which a test may set.
    adjust(&mut command);
    let child = command
        .arg("-l")
        .arg(&lb_path)
        .arg("-c")
        .arg(&pingora_path)
        .stdout(std::fs::File::create(dir.path().join("stdout.log")).unwrap())
        .stderr(std::fs::File::create(dir.path().join("stderr.log")).unwrap())
        .spawn()
        .unwrap();
    Proxy {
        child,
        addr,
        admin,
        dir,
    }
}

/// Sends `signal` (a name `kill -s` takes: TERM, QUIT, HUP, INT) to `pid`.
pub fn send_signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -s {signal} {pid}");
}

/// Waits for `child` to exit by itself, cleanly, within `limit`; returns when it did.
pub async fn exits(child: &mut Child, limit: Duration) -> Instant {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "exited with {status}");
            return Instant::now();
        }
        assert!(
            start.elapsed() < limit,
            "process still running after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
