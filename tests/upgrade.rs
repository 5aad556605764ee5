//! Zero-downtime binary upgrades, 20 in a row, under continuous load from keep-alive clients and
//! from clients that open a connection per request, with SSE streams spanning the upgrades:
//! Pingora hands the listening sockets over, each old process finishes what it has, and exits
//! soon after its last stream; no client sees an error.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use futures_util::StreamExt;

const UPGRADES: usize = 20;

/// A process of the test's, killed if the test ends before it exits.
struct Owned(Child);

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

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

fn spawn(dir: &Path, name: &str, upgrade: bool) -> Owned {
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
async fn start_first(dir: &Path, port: u16, lb: TestConfig) -> Owned {
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
async fn took_over(dir: &Path, name: &str) {
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

/// The end of the last response in an access log (JSON lines), if any.
fn last_end(log: &str) -> Option<SystemTime> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["time"].as_str()?.parse::<jiff::Timestamp>().ok())
        .max()
        .map(|t| SystemTime::UNIX_EPOCH + Duration::from_millis(t.as_millisecond() as u64))
}

/// One client loop: short requests or 1.2 s streams, on a shared (keep-alive) client or on a
/// fresh connection each time, until `stop`.
fn worker(
    url: String,
    keep_alive: bool,
    stream: bool,
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failures: Arc<Mutex<Vec<String>>>,
) -> tokio::task::JoinHandle<()> {
    let shared = reqwest::Client::new();
    tokio::spawn(async move {
        let mut i = 0;
        while !stop.load(Ordering::SeqCst) {
            i += 1;
            let c = if keep_alive {
                shared.clone()
            } else {
                reqwest::Client::builder()
                    .pool_max_idle_per_host(0)
                    .build()
                    .unwrap()
            };
            let mut req = c
                .post(&url)
                .body(chat("s", &format!("c{}", i % 7), 1, stream));
            if stream {
                req = req
                    .header("x-mock-events", "30")
                    .header("x-mock-interval-ms", "40");
            }
            let outcome = async {
                let r = req.send().await.map_err(|e| format!("send: {e:?}"))?;
                if r.status() != 200 {
                    let status = r.status();
                    return Err(format!(
                        "status {status}: {}",
                        r.text().await.unwrap_or_default()
                    ));
                }
                let mut body = r.bytes_stream();
                let mut text = String::new();
                while let Some(chunk) = body.next().await {
                    text.push_str(&String::from_utf8_lossy(
                        &chunk.map_err(|e| format!("body: {e:?}"))?,
                    ));
                }
                if stream && !text.ends_with("data: [DONE]\n\n") {
                    return Err(format!(
                        "stream cut after {} events",
                        text.matches("data: ").count()
                    ));
                }
                Ok(())
            }
            .await;
            match outcome {
                Ok(()) => {
                    ok.fetch_add(1, Ordering::SeqCst);
                }
                Err(e) => failures
                    .lock()
                    .unwrap()
                    .push(format!("keep_alive={keep_alive} stream={stream}: {e}")),
            }
        }
    })
}

/// An old process: when it was told to hand over, and when it exited.
struct Retired {
    name: String,
    quit: SystemTime,
    exited: Arc<Mutex<Option<SystemTime>>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_upgrades_under_keep_alive_and_fresh_load_fail_nothing() {
    let ups = upstreams::<2>().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (free_port(), free_port());
    let mut current = start_first(
        dir.path(),
        port,
        TestConfig::new().admin_on(loopback(admin)).peers(&ups),
    )
    .await;

    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let stop = Arc::new(AtomicBool::new(false));
    let (short_ok, streams_ok) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut load = Vec::new();
    for (keep_alive, stream, n) in [
        (true, false, 3),
        (false, false, 2),
        (true, true, 3),
        (false, true, 1),
    ] {
        for _ in 0..n {
            let ok = if stream { &streams_ok } else { &short_ok };
            load.push(worker(
                url.clone(),
                keep_alive,
                stream,
                stop.clone(),
                ok.clone(),
                failures.clone(),
            ));
        }
    }

    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut retired = Vec::new();
    let mut reapers = Vec::new();
    for generation in 1..=UPGRADES {
        // The successor first: it waits on the upgrade socket, then the old process is told to
        // hand its sockets over, the order the systemd unit uses.
        let name = format!("p{generation}");
        let next = spawn(dir.path(), &name, true);
        let mut old = std::mem::replace(&mut current, next);
        let quit = SystemTime::now();
        send_signal(old.id(), "QUIT");
        let exited = Arc::new(Mutex::new(None));
        retired.push(Retired {
            name: format!("p{}", generation - 1),
            quit,
            exited: exited.clone(),
        });
        reapers.push(tokio::spawn(async move {
            exits(&mut old, Duration::from_secs(30)).await;
            *exited.lock().unwrap() = Some(SystemTime::now());
        }));
        // Then a little traffic on the successor alone.
        took_over(dir.path(), &name).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    for r in reapers {
        r.await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    for t in load {
        t.await.unwrap();
    }
    let read = |file: String| std::fs::read_to_string(dir.path().join(file)).unwrap_or_default();
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} requests failed, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)],
    );
    assert!(short_ok.load(Ordering::SeqCst) > 200, "short: {short_ok:?}");
    assert!(
        streams_ok.load(Ordering::SeqCst) > 60,
        "streams: {streams_ok:?}"
    );
    // Pingora keeps accepting for 5 s after the hand-over; from then on each old process stays
    // only while it has work, and leaves within a second of its last response.
    let close_after = Duration::from_secs(5);
    for r in &retired {
        let exited = r.exited.lock().unwrap().expect("reaped");
        let log = read(format!("{}.access.log", r.name));
        let last = last_end(&log).unwrap_or(r.quit);
        let settled = last.max(r.quit + close_after);
        let lingered = exited.duration_since(settled).unwrap_or_default();
        assert!(
            lingered < Duration::from_millis(1100),
            "{} exited {lingered:?} after its work ended: {}",
            r.name,
            read(format!("{}.log", r.name))
        );
        assert!(
            last > r.quit,
            "{} served nothing after it was told to hand over",
            r.name
        );
    }
    assert!(!read(format!("p{UPGRADES}.access.log")).is_empty());
}

/// The `ExecStart=`/`ExecReload=` command lines of the shipped unit, with its paths pointed at
/// `dir` and `binary`, as systemd would run them for this test.
fn unit_commands(key: &str, dir: &Path, binary: &Path, main_pid: u32) -> Vec<Vec<String>> {
    let unit = std::fs::read_to_string("systemd/prefixlb.service").unwrap();
    let prefix = format!("{key}=");
    unit.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .map(|line| {
            line.replace("/usr/bin/prefixlb", binary.to_str().unwrap())
                .replace("/etc/prefixlb/", &format!("{}/", dir.display()))
                .replace("$MAINPID", &main_pid.to_string())
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        })
        .collect()
}

/// Runs `commands` in order and stops at the first that fails, as systemd does; true when all
/// succeeded.
fn run_all(commands: &[Vec<String>], dir: &Path) -> bool {
    commands.iter().all(|argv| {
        let log = |name: &str| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join(name))
                .unwrap()
        };
        let status = Command::new(&argv[0])
            .args(&argv[1..])
            .env("RUST_LOG", "info")
            .stdout(log("daemon.access.log"))
            .stderr(log("daemon.log"))
            .status()
            .unwrap();
        if !status.success() {
            eprintln!("{} failed: {status}", argv.join(" "));
        }
        status.success()
    })
}

/// The daemons the PID file has named, stopped when dropped.
struct Daemon(std::path::PathBuf, std::cell::RefCell<Vec<u32>>);

impl Daemon {
    /// The PID the file names. A daemon writes the file by truncating it first, and the new
    /// one of an upgrade writes it while the test reads: an empty or missing file is read again
    /// for up to 2 s.
    fn pid(&self) -> u32 {
        let start = Instant::now();
        let pid = loop {
            let text = std::fs::read_to_string(&self.0).unwrap_or_default();
            if let Ok(pid) = text.trim().parse() {
                break pid;
            }
            assert!(
                start.elapsed() < Duration::from_secs(2),
                "{} names no process: {text:?}",
                self.0.display()
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        self.1.borrow_mut().push(pid);
        pid
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // Only ours: a PID that has exited may have been given to another process since.
        let ours = |pid: &&u32| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains("prefixlb"))
        };
        for pid in self.1.borrow().iter().filter(ours) {
            let _ = Command::new("kill")
                .args(["-s", "KILL", &pid.to_string()])
                .status();
        }
    }
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_units_reload_upgrades_and_a_new_process_that_fails_costs_nothing() {
    let up = start_upstream("a").await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let lb = TestConfig::new()
        .listen_on(loopback(port))
        .no_admin()
        .no_health_check()
        .peers(&[&up]);
    std::fs::write(dir.path().join("prefixlb.yaml"), lb.to_yaml()).unwrap();
    let shipped = std::fs::read_to_string("systemd/pingora.yaml").unwrap();
    std::fs::write(
        dir.path().join("pingora.yaml"),
        shipped.replace("/run/prefixlb/", &format!("{}/", dir.path().display())),
    )
    .unwrap();
    let real = binary();
    assert!(run_all(
        &unit_commands("ExecStartPre", dir.path(), &real, 0),
        dir.path()
    ));
    assert!(run_all(
        &unit_commands("ExecStart", dir.path(), &real, 0),
        dir.path()
    ));
    let daemon = Daemon(dir.path().join("prefixlb.pid"), Default::default());
    let url = format!("http://127.0.0.1:{port}/v1/completions");
    let serves = || async {
        let r = client().post(&url).body(r#"{"prompt":"x"}"#).send().await;
        r.is_ok_and(|r| r.status() == 200)
    };
    wait_listening(format!("127.0.0.1:{port}").parse().unwrap(), "prefixlb").await;
    assert!(serves().await);

    // A good reload: a new process takes over and the old one leaves.
    let first = daemon.pid();
    assert!(
        run_all(
            &unit_commands("ExecReload", dir.path(), &real, first),
            dir.path()
        ),
        "{}",
        std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default()
    );
    // While both run, the new daemon's in-flight counts are in the shared file under its own
    // process id, not the launcher's.
    let shared = dir.path().join("prefixlb.inflight");
    let mut seen_sharing = false;
    let start = Instant::now();
    while alive(first) {
        let table = std::fs::read_to_string(&shared).unwrap_or_default();
        seen_sharing |= table.contains(&format!("\"{}\"", daemon.pid()));
        assert!(serves().await, "a request failed during the upgrade");
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "the old process stayed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let second = daemon.pid();
    assert_ne!(second, first);
    assert!(seen_sharing, "the new daemon never shared its counts");
    assert!(alive(second) && serves().await);

    // A new build that passes the check but cannot start: the reload fails before the old
    // process is told anything, and it goes on serving.
    let broken = dir.path().join("broken-prefixlb");
    std::fs::write(
        &broken,
        format!(
            "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -t ] && exec {} \"$@\"; done\nexit 1\n",
            real.display()
        ),
    )
    .unwrap();
    let mut perms = std::fs::metadata(&broken).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&broken, perms).unwrap();
    assert!(!run_all(
        &unit_commands("ExecReload", dir.path(), &broken, second),
        dir.path()
    ));
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(daemon.pid(), second);
    assert!(alive(second) && serves().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_gpu_goes_over_max_in_flight_while_streams_span_upgrades() {
    let ups = upstreams::<2>().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut current = start_first(
        dir.path(),
        port,
        TestConfig::new()
            .no_admin()
            .no_health_check()
            .peers(&ups)
            .max_in_flight(2),
    )
    .await;
    // Twice the cluster's four slots in streams, always: every process has a waiting line.
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let load: Vec<_> = (0..8)
        .map(|_| {
            worker(
                url.clone(),
                false,
                true,
                stop.clone(),
                ok.clone(),
                failures.clone(),
            )
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut old_ones = Vec::new();
    for generation in 1..=3 {
        let name = format!("p{generation}");
        let next = spawn(dir.path(), &name, true);
        let old = std::mem::replace(&mut current, next);
        send_signal(old.id(), "QUIT");
        old_ones.push(old);
        took_over(dir.path(), &name).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    for mut old in old_ones {
        exits(&mut old, Duration::from_secs(30)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for t in load {
        t.await.unwrap();
    }
    let failures = failures.lock().unwrap().clone();
    assert!(failures.is_empty(), "{failures:?}");
    assert!(ok.load(Ordering::SeqCst) > 20, "{ok:?}");
    for u in &ups {
        assert!(
            u.peak.load(Ordering::SeqCst) <= 2,
            "{} carried {} streams at once, over its max_in_flight of 2",
            u.name,
            u.peak.load(Ordering::SeqCst)
        );
    }
}

/// The replicas' UDP port is shared across an upgrade: the new process binds it while the old
/// one still holds it, and hears what another replica tells once the old one is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_process_hears_the_other_replicas() {
    let ups = upstreams::<2>().await;
    let peers = TestConfig::new().peers(&ups);
    let told = replicas(2);
    let sibling = start_proxy(&peers.clone().replica(&told[1])).await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (free_port(), free_port());
    let old = start_first(
        dir.path(),
        port,
        peers
            .admin_on(loopback(admin))
            .no_health_check()
            .engine_metrics(false)
            .replica(&told[0]),
    )
    .await;
    let new = spawn(dir.path(), "p1", true);
    send_signal(old.id(), "QUIT");
    took_over(dir.path(), "p1").await;
    drop(old);
    let heard = || async {
        let metrics = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        sample(
            &metrics,
            r#"prefixlb_replica_messages_total{event="heard"}"#,
        )
    };
    let c = client();
    let start = Instant::now();
    let mut conversation = 0;
    while heard().await < 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the new process heard nothing"
        );
        // Each new conversation is recorded, and told, by the sibling.
        conversation += 1;
        let body = chat(&"s".repeat(3000), &format!("q{conversation}"), 1, false);
        let r = c
            .post(sibling.url("/v1/chat/completions"))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = std::fs::read_to_string(dir.path().join("p1.log")).unwrap();
    assert!(
        !log.contains("cannot listen"),
        "the new process could not bind the replicas' port while the old one held it: {log}"
    );
    drop(new);
}
