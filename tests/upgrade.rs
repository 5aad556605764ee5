//! Zero-downtime binary upgrade, twice in a row (old → new → newer), under continuous load of
//! short requests and long SSE streams: Pingora hands the listening sockets over, the old
//! process finishes what it has, and no client sees an error.

mod common;

use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use futures_util::StreamExt;

fn spawn(dir: &Path, name: &str, upgrade: bool) -> Child {
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
        .unwrap()
}

fn quit(child: &Child) {
    let ok = Command::new("kill")
        .args(["-QUIT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
}

/// Waits for the process to exit by itself; it must, within `limit`, and cleanly.
async fn exits(child: &mut Child, limit: Duration) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(status.success(), "exited with {status}");
            return;
        }
        assert!(
            start.elapsed() < limit,
            "old process still running after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Access-log lines of `log` for responses that ended after `after`.
fn ended_after(log: &str, after: SystemTime) -> usize {
    let after = jiff::Timestamp::try_from(after).unwrap();
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| {
            v["time"]
                .as_str()
                .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                .is_some_and(|t| t > after)
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_upgrades_in_a_row_under_load_fail_nothing() {
    let ups = upstreams::<2>().await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (free_port(), free_port());
    std::fs::write(
        dir.path().join("prefixlb.yaml"),
        format!(
            "listen: [\"127.0.0.1:{port}\"]\nadmin: {{listen: \"127.0.0.1:{admin}\"}}\naccess_log: json\n{}",
            peers_yaml(&ups, None)
        ),
    )
    .unwrap();
    // Streams last 1.2 s; the grace period of 2 s lets every one that started on the old
    // process finish there.
    std::fs::write(
        dir.path().join("pingora.yaml"),
        format!(
            "version: 1\nthreads: 2\npid_file: {d}/prefixlb.pid\nupgrade_sock: {d}/upgrade.sock\ngrace_period_seconds: 2\ngraceful_shutdown_timeout_seconds: 2\n",
            d = dir.path().display()
        ),
    )
    .unwrap();
    let mut old = spawn(dir.path(), "old", false);
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let start = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "proxy did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // A fresh connection per request, as a fleet of clients has: an idle keep-alive
    // connection closed by the old process would be the client's to retry, and is not what
    // this test is about.
    let c = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (short_ok, streams_ok) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut load = Vec::new();
    for w in 0..8u64 {
        let (c, url, stop, failures) = (c.clone(), url.clone(), stop.clone(), failures.clone());
        let counter = if w < 4 {
            short_ok.clone()
        } else {
            streams_ok.clone()
        };
        load.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                let stream = w >= 4;
                let mut req = c
                    .post(&url)
                    .body(chat("s", &format!("w{w} c{}", i % 5), 1, stream));
                if stream {
                    req = req
                        .header("x-mock-events", "30")
                        .header("x-mock-interval-ms", "40");
                }
                let outcome = async {
                    let r = req.send().await.map_err(|e| format!("send: {e:?}"))?;
                    if r.status() != 200 {
                        return Err(format!("status {}", r.status()));
                    }
                    let mut body = r.bytes_stream();
                    let mut text = String::new();
                    while let Some(chunk) = body.next().await {
                        text.push_str(&String::from_utf8_lossy(
                            &chunk.map_err(|e| format!("body: {e}"))?,
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
                        counter.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(e) => failures.lock().unwrap().push(e),
                }
            }
        }));
    }

    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut quit_times = Vec::new();
    for generation in ["new", "newer"] {
        // SIGQUIT first: the old process offers its sockets (retrying for 5 s) while the new
        // one starts and takes them, the order the systemd unit uses.
        quit(&old);
        quit_times.push(SystemTime::now());
        let next = spawn(dir.path(), generation, true);
        // The old process accepts for 5 s more, drains for the grace period, then exits.
        exits(&mut old, Duration::from_secs(15)).await;
        old = next;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    for t in load {
        t.await.unwrap();
    }
    let log = |name: &str| {
        std::fs::read_to_string(dir.path().join(format!("{name}.log"))).unwrap_or_default()
    };
    let access = |name: &str| {
        std::fs::read_to_string(dir.path().join(format!("{name}.access.log"))).unwrap_or_default()
    };
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} requests failed, e.g. {:?}\nold: {}\nnew: {}",
        failures.len(),
        &failures[..failures.len().min(5)],
        log("old"),
        log("new")
    );
    assert!(
        short_ok.load(Ordering::SeqCst) > 100,
        "short: {}",
        short_ok.load(Ordering::SeqCst)
    );
    assert!(
        streams_ok.load(Ordering::SeqCst) > 20,
        "streams: {}",
        streams_ok.load(Ordering::SeqCst)
    );
    // The old processes really served through their drain, and the new ones took over.
    assert!(
        ended_after(&access("old"), quit_times[0]) > 0,
        "the first process served nothing after SIGQUIT"
    );
    assert!(
        ended_after(&access("new"), quit_times[1]) > 0,
        "the second process served nothing after SIGQUIT"
    );
    assert!(
        !access("newer").is_empty(),
        "the newest process served nothing"
    );
    assert!(
        log("new").contains("listener sockets sent") || log("new").contains("sockets sent"),
        "{}",
        log("new")
    );
    let _ = old.kill();
    let _ = old.wait();
}
