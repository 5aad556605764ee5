//! Upgrades under continuous load: twenty in a row under keep-alive and fresh-connection
//! clients and SSE streams, each old process leaving soon after its last response; and no
//! engine above its `max_in_flight` while streams span the upgrades.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::StreamExt;

use crate::common::*;
use crate::{loopback, spawn, start_first, took_over};

const UPGRADES: usize = 20;

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
