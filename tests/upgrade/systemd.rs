//! The shipped systemd unit's own command lines, run as systemd would: its reload upgrades, and
//! a new build that cannot start fails the reload and costs nothing.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::loopback;

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

/// Runs `commands` in order from `dir` and stops at the first that fails, as systemd does;
/// true when all succeeded.
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
            .current_dir(dir)
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

/// Waits up to 5 s for the daemons' access log to hold `at_least` request lines; their count.
async fn access_lines(dir: &Path, at_least: usize) -> usize {
    let start = Instant::now();
    loop {
        let log = std::fs::read_to_string(dir.join("daemon.access.log")).unwrap_or_default();
        let n = log
            .lines()
            .filter(|l| l.contains("/v1/completions"))
            .count();
        if n >= at_least {
            return n;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{n} access log lines, {at_least} expected: {log:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
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
        .peers(&[&up])
        .access_log("json");
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
    // Named first, so that the daemon is stopped whatever fails after.
    let first = daemon.pid();
    assert!(serves().await);
    // The daemon writes its access log: its writer is started after the fork, which no
    // thread survives.
    let logged = access_lines(dir.path(), 1).await;

    // A good reload: a new process takes over and the old one leaves.
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
    // The second daemon logs what it serves: once the lines of the requests above are out
    // (both write within 20 ms; the first before it exited), one more request is one more line.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = access_lines(dir.path(), logged).await;
    assert!(alive(second) && serves().await);
    access_lines(dir.path(), before + 1).await;

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

/// A daemon runs from `/`, and parses its configuration again at each change of it: a file the
/// configuration names by a relative path is still found there, so the change is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_whose_configuration_names_relative_paths_takes_its_changes() {
    let (a, b) = (start_upstream("a").await, start_upstream("b").await);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("keys.yaml"),
        format!("keys:\n  - {{name: t, sha256: {}}}\n", sha256_hex(b"k1")),
    )
    .unwrap();
    let port = free_port();
    let lb = |up: &Upstream| {
        TestConfig::new()
            .listen_on(loopback(port))
            .no_admin()
            .no_health_check()
            .peers(&[up])
            .keys_file(Path::new("keys.yaml"))
            .to_yaml()
    };
    std::fs::write(dir.path().join("prefixlb.yaml"), lb(&a)).unwrap();
    let shipped = std::fs::read_to_string("systemd/pingora.yaml").unwrap();
    std::fs::write(
        dir.path().join("pingora.yaml"),
        shipped.replace("/run/prefixlb/", &format!("{}/", dir.path().display())),
    )
    .unwrap();
    assert!(run_all(
        &unit_commands("ExecStart", dir.path(), &binary(), 0),
        dir.path()
    ));
    let daemon = Daemon(dir.path().join("prefixlb.pid"), Default::default());
    daemon.pid();
    wait_listening(format!("127.0.0.1:{port}").parse().unwrap(), "prefixlb").await;
    let url = format!("http://127.0.0.1:{port}/v1/completions");
    let serves = || async {
        let r = client()
            .post(&url)
            .header("authorization", "Bearer k1")
            .body(r#"{"prompt":"x"}"#)
            .send()
            .await;
        r.is_ok_and(|r| r.status() == 200)
    };
    assert!(serves().await);
    assert_eq!(a.seen().len(), 1);

    std::fs::write(dir.path().join("prefixlb.yaml"), lb(&b)).unwrap();
    let start = Instant::now();
    while b.seen().is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the change was not taken: {}",
            std::fs::read_to_string(dir.path().join("daemon.log")).unwrap_or_default()
        );
        assert!(serves().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
