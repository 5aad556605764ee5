//! prefixlb as it is deployed: one process at a time reading its peers from a file, replaced
//! by binary upgrades (a new process started with `-u`, SIGQUIT to the old one, the listening
//! sockets handed over on Pingora's upgrade socket), each generation's logs kept apart.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::common::{binary, free_addr, send_signal, PeerEntry, PingoraConfig, TestConfig};

/// One prefixlb process.
pub struct Generation {
    pub index: usize,
    pub pid: u32,
    child: Option<Child>,
    /// Seconds from the start of the load.
    pub started_s: f64,
    /// When it was told to hand over (SIGQUIT).
    pub quit_s: Option<f64>,
    pub exited: Option<Exit>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Exit {
    pub at_s: f64,
    pub clean: bool,
    pub status: String,
}

impl Generation {
    pub fn alive(&self) -> bool {
        self.exited.is_none()
    }
}

pub struct Lb {
    dir: PathBuf,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub gens: Vec<Generation>,
    epoch: Instant,
}

impl Lb {
    /// The first generation, listening on `addr`, with its peers from `peers` written to the
    /// peers file first.
    pub async fn start(
        dir: &Path,
        peers: &[(String, u32)],
        epoch: Instant,
    ) -> Result<Self, String> {
        let (addr, admin) = (free_addr(), free_addr());
        let mut lb = Self {
            dir: dir.to_owned(),
            addr,
            admin,
            gens: Vec::new(),
            epoch,
        };
        lb.write_peers(peers)?;
        let config = TestConfig::new()
            .listen_on(addr)
            .admin_on(admin)
            .peers_file(&lb.peers_path())
            .reload_interval_ms(500)
            // The prefix record is allocated at start but paged in as blocks land in it: at its
            // 16 MiB default this load touches it all only after half an hour, and that growth
            // would hide or mimic a leak. At 1 MiB it is resident within the warm-up and evicts
            // all along, the path a long-running process lives on.
            .advanced("prefix_record_bytes", "1048576");
        write(
            &dir.join("prefixlb.yaml"),
            &with_json_access_log(&config.to_yaml())?,
        )?;
        // A long grace period: an old process must leave when its work is done, long before.
        let pingora = PingoraConfig::new()
            .threads(2)
            .pid_file(&dir.join("prefixlb.pid"))
            .upgrade_sock(&dir.join("upgrade.sock"))
            .grace_seconds(60, 5);
        write(&dir.join("pingora.yaml"), &pingora.to_yaml())?;
        lb.spawn(false)?;
        let start = Instant::now();
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            lb.reap();
            if !lb.gens[0].alive() || start.elapsed() > Duration::from_secs(20) {
                return Err(format!("prefixlb did not start: {}", lb.log(0)));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(lb)
    }

    fn peers_path(&self) -> PathBuf {
        self.dir.join("peers.yaml")
    }

    /// Rewrites the peers file whole, by a rename, as a deployment tool would.
    pub fn write_peers(&self, peers: &[(String, u32)]) -> Result<(), String> {
        let list = peers.iter().fold(TestConfig::new(), |c, (addr, weight)| {
            c.peer(PeerEntry::at(addr).weight(*weight))
        });
        let tmp = self.dir.join("peers.yaml.new");
        write(&tmp, &list.to_yaml())?;
        std::fs::rename(&tmp, self.peers_path()).map_err(|e| e.to_string())
    }

    fn spawn(&mut self, upgrade: bool) -> Result<(), String> {
        let index = self.gens.len();
        let file = |suffix: &str| {
            std::fs::File::create(self.dir.join(format!("gen-{index}.{suffix}")))
                .map_err(|e| e.to_string())
        };
        let mut command = Command::new(binary());
        command
            .arg("-l")
            .arg(self.dir.join("prefixlb.yaml"))
            .arg("-c")
            .arg(self.dir.join("pingora.yaml"));
        if upgrade {
            command.arg("-u");
        }
        let child = command
            .env("RUST_LOG", "info")
            .stdout(file("access.log")?)
            .stderr(file("log")?)
            .spawn()
            .map_err(|e| format!("{}: {e}", binary().display()))?;
        self.gens.push(Generation {
            index,
            pid: child.id(),
            child: Some(child),
            started_s: self.epoch.elapsed().as_secs_f64(),
            quit_s: None,
            exited: None,
        });
        Ok(())
    }

    /// The newest generation: the one serving once an upgrade is done.
    pub fn newest(&self) -> &Generation {
        self.gens.last().expect("a first generation")
    }

    /// Starts the next generation and tells the current one to hand over, in the order the
    /// systemd unit uses: the new process waits on the upgrade socket for the old one's.
    pub fn begin_upgrade(&mut self) -> Result<(), String> {
        let old = self.gens.len() - 1;
        self.spawn(true)?;
        send_signal(self.gens[old].pid, "QUIT");
        self.gens[old].quit_s = Some(self.epoch.elapsed().as_secs_f64());
        Ok(())
    }

    /// Whether the newest generation has taken the sockets over, as its log says; an error
    /// when it exited first.
    pub fn took_over(&mut self) -> Result<bool, String> {
        self.reap();
        let newest = self.gens.len() - 1;
        if self.log(newest).contains("Bootstrap done") {
            return Ok(true);
        }
        match &self.gens[newest].exited {
            Some(exit) => Err(format!("gen-{newest} exited ({})", exit.status)),
            None => Ok(false),
        }
    }

    /// Records the exit of every generation that has left.
    pub fn reap(&mut self) {
        let now = self.epoch.elapsed().as_secs_f64();
        for g in &mut self.gens {
            if let Some(child) = g.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    g.exited = Some(Exit {
                        at_s: now,
                        clean: status.success(),
                        status: status.to_string(),
                    });
                    g.child = None;
                }
            }
        }
    }

    pub fn log(&self, index: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("gen-{index}.log"))).unwrap_or_default()
    }

    pub fn access_log(&self, index: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("gen-{index}.access.log")))
            .unwrap_or_default()
    }
}

impl Drop for Lb {
    fn drop(&mut self) {
        for g in &mut self.gens {
            if let Some(mut child) = g.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// `yaml` with a JSON access log, the key read back for each failed request, set in its
/// current form (`access_log.format`): the builder's older one is logged as renamed.
fn with_json_access_log(yaml: &str) -> Result<String, String> {
    let mut config: serde_yaml::Mapping = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
    let mut access_log = serde_yaml::Mapping::new();
    access_log.insert("format".into(), "json".into());
    config.insert("access_log".into(), access_log.into());
    serde_yaml::to_string(&config).map_err(|e| e.to_string())
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The warnings and errors of a generation's log, each message once with its count; numbers
/// (ports, counts, durations) are masked so that repeats of one message group together.
pub fn log_problems(log: &str) -> Vec<(String, usize)> {
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for line in log.lines() {
        // env_logger: `[time LEVEL target] message`.
        let Some((head, message)) = line.strip_prefix('[').and_then(|l| l.split_once("] ")) else {
            continue;
        };
        let mut fields = head.split_whitespace();
        let (Some(level), Some(target)) = (fields.nth(1), fields.next()) else {
            continue;
        };
        if level != "WARN" && level != "ERROR" {
            continue;
        }
        let mut masked = String::new();
        for c in message.chars().take(300) {
            if !c.is_ascii_digit() {
                masked.push(c);
            } else if !masked.ends_with('#') {
                masked.push('#');
            }
        }
        *counts
            .entry(format!("{level} {target}: {masked}"))
            .or_default() += 1;
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.1));
    v
}
