//! Hot reload of the peer list: a peers file rewritten under load, on SIGHUP, invalid, empty or
//! written in pieces.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use crate::common::*;
use crate::{listed, peer, served_by, sorted, until, CHAT};

fn write_peers(path: &std::path::Path, peers: &[(&Upstream, u32)]) {
    let file = peers.iter().fold(TestConfig::new(), |file, (u, w)| {
        file.peer(PeerEntry::at(u.addr).weight(*w))
    });
    // Write then rename, as configuration management does, so a reader never sees half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, file.to_yaml()).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewriting_the_peers_file_under_load_fails_no_request() {
    let ups = upstreams::<4>().await;
    let dir = tempfile::tempdir().unwrap();
    let peers_file = dir.path().join("peers.yaml");
    write_peers(&peers_file, &[(&ups[0], 1), (&ups[1], 1)]);
    let cfg = TestConfig::new()
        .peers_file(&peers_file)
        .reload_interval_ms(10);
    let proxy = Arc::new(start_proxy(&cfg).await);
    let c = client();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ok, failed) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(Mutex::new(Vec::new())),
    );
    let mut load = Vec::new();
    for w in 0..12u64 {
        let (c, proxy, stop, ok, failed) = (
            c.clone(),
            Arc::clone(&proxy),
            stop.clone(),
            ok.clone(),
            failed.clone(),
        );
        load.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                let streaming = w % 2 == 0;
                let mut req = c.post(proxy.url(CHAT)).body(chat(
                    "s",
                    &format!("w{w} c{}", i % 9),
                    1,
                    streaming,
                ));
                if streaming {
                    req = req
                        .header("x-mock-events", "6")
                        .header("x-mock-interval-ms", "20");
                }
                let outcome = match req.send().await {
                    Ok(r) if r.status() == 200 => {
                        let mut s = r.bytes_stream();
                        let mut text = String::new();
                        let mut broken = None;
                        while let Some(chunk) = s.next().await {
                            match chunk {
                                Ok(b) => text.push_str(&String::from_utf8_lossy(&b)),
                                Err(e) => broken = Some(e.to_string()),
                            }
                        }
                        match broken {
                            Some(e) => Err(e),
                            None if streaming && !text.ends_with("data: [DONE]\n\n") => {
                                Err(format!("cut stream: {text}"))
                            }
                            None => Ok(()),
                        }
                    }
                    Ok(r) => Err(format!("status {}", r.status())),
                    Err(e) => Err(e.to_string()),
                };
                match outcome {
                    Ok(()) => ok.fetch_add(1, Ordering::SeqCst),
                    Err(e) => {
                        failed.lock().unwrap().push(e);
                        0
                    }
                };
            }
        }));
    }
    // 100 rewrites: adds, removes and weight changes, never an empty list. Each must be in
    // force, with no removed peer still listed, before the next is written: a fixed pause
    // between rewrites measured the machine's load more than the reload.
    let mut changes = 0;
    let mut last = sorted(members(proxy.peers().await));
    for round in 0..100usize {
        let mut set: Vec<(&Upstream, u32)> = Vec::new();
        for (i, u) in ups.iter().enumerate() {
            if (round * 7 + i * 3) % 5 != 0 || i == round % 4 {
                set.push((u, 1 + ((round + i) % 3) as u32));
            }
        }
        write_peers(&peers_file, &set);
        let want = sorted(
            set.iter()
                .map(|(u, w)| (u.addr_str(), u64::from(*w)))
                .collect(),
        );
        changes += usize::from(want != last);
        until(&proxy, Duration::from_secs(5), |l| {
            sorted(members(l.clone())) == want
        })
        .await;
        last = want;
    }
    stop.store(true, Ordering::SeqCst);
    for t in load {
        t.await.unwrap();
    }
    let failed = failed.lock().unwrap().clone();
    assert!(
        failed.is_empty(),
        "{} requests failed, e.g. {:?}",
        failed.len(),
        &failed[..failed.len().min(3)]
    );
    assert!(
        ok.load(Ordering::SeqCst) > 200,
        "too little load: {}",
        ok.load(Ordering::SeqCst)
    );
    assert!(
        changes >= 50,
        "only {changes} of 100 rewrites changed the list"
    );
    let listing = proxy.wait_idle(Duration::from_secs(5)).await;
    assert_eq!(listing["in_flight"], 0, "{listing}");
    for p in listing["peers"].as_array().unwrap() {
        assert_eq!(p["in_flight"], 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_peers_section_of_the_config_file() {
    let ups = upstreams::<2>().await;
    // Checked for changes only once a minute: the reload below is the signal's doing.
    let cfg = TestConfig::new().reload_interval_ms(60000);
    let proxy = start_proxy(&cfg.clone().peers(&[&ups[0]])).await;
    proxy.rewrite_config(&cfg.peers(&ups));
    let status = std::process::Command::new("kill")
        .args(["-HUP", &proxy.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    until(&proxy, Duration::from_secs(3), |l| {
        l["peers"].as_array().unwrap().len() == 2
    })
    .await;
    assert_eq!(
        peer(&proxy.peers().await, &ups[1].addr_str())["healthy"],
        true
    );
}

/// A configuration that fails for something outside it (a file it names, not there yet) is
/// parsed again at each check, said once, and taken once that is mended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_failing_on_a_missing_file_is_taken_once_the_file_is_there() {
    let ups = upstreams::<2>().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.yaml");
    let cfg = TestConfig::new().reload_interval_ms(50);
    let proxy = start_proxy(&cfg.clone().peers(&[&ups[0]])).await;
    proxy.rewrite_config(&cfg.peers(&ups).keys_file(&keys));
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(proxy.peers().await["peers"].as_array().unwrap().len(), 1);
    std::fs::write(&keys, "keys: []\n").unwrap();
    until(&proxy, Duration::from_secs(3), |l| {
        l["peers"].as_array().unwrap().len() == 2
    })
    .await;
    let log = proxy.log();
    assert_eq!(
        log.matches("auth.keys_file").count(),
        1,
        "said once, not at every check: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_peers_file_leaves_routing_unchanged() {
    let ups = upstreams::<2>().await;
    let dir = tempfile::tempdir().unwrap();
    let peers_file = dir.path().join("peers.yaml");
    write_peers(&peers_file, &[(&ups[0], 1), (&ups[1], 1)]);
    let cfg = TestConfig::new()
        .peers_file(&peers_file)
        .reload_interval_ms(20);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let before = members(proxy.peers().await);
    let mut homes = Vec::new();
    for i in 0..20 {
        homes.push(served_by(&c, &proxy, &format!("k{i}")).await);
    }
    for bad in [
        "peers: [{addr: \"127.0.0.1:1\", weight: 0}]",
        "peers: [{adress: \"127.0.0.1:1\"}]",
        "peers: {not: a list}",
        ": : :",
    ] {
        std::fs::write(&peers_file, bad).unwrap();
        // A check and the settling time of a file rewritten in place.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            members(proxy.peers().await),
            before,
            "{bad} changed the peers"
        );
        for (i, home) in homes.iter().enumerate() {
            assert_eq!(&served_by(&c, &proxy, &format!("k{i}")).await, home);
        }
    }
    let log = proxy.log();
    assert!(
        log.contains("peers[0].weight") && log.contains("must be from 1 to"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_peer_list_is_refused_unless_allowed() {
    let ups = upstreams::<2>().await;
    for allow in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let peers_file = dir.path().join("peers.yaml");
        write_peers(&peers_file, &[(&ups[0], 1), (&ups[1], 1)]);
        let cfg = TestConfig::new()
            .peers_file(&peers_file)
            .reload_interval_ms(20)
            .allow_empty(allow)
            .no_health_check();
        let proxy = start_proxy(&cfg).await;
        let before = listed(&proxy.peers().await);
        assert_eq!(before.len(), 2);
        for empty in ["peers: []\n", ""] {
            std::fs::write(&peers_file, empty).unwrap();
            if allow {
                // Written in place: read once it has settled (200 ms), however loaded the machine.
                until(&proxy, Duration::from_secs(3), |l| listed(l).is_empty()).await;
                write_peers(&peers_file, &[(&ups[0], 1), (&ups[1], 1)]);
                until(&proxy, Duration::from_secs(3), |l| listed(l) == before).await;
            } else {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let now = listed(&proxy.peers().await);
                assert_eq!(now, before, "{empty:?} emptied the cluster");
            }
        }
        assert_eq!(
            proxy.log().contains("the new list is empty"),
            !allow,
            "{}",
            proxy.log()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_file_written_in_pieces_is_read_only_once_whole() {
    let ups = upstreams::<3>().await;
    let dir = tempfile::tempdir().unwrap();
    let peers_file = dir.path().join("peers.yaml");
    write_peers(&peers_file, &[(&ups[0], 1), (&ups[1], 1), (&ups[2], 1)]);
    let cfg = TestConfig::new()
        .peers_file(&peers_file)
        .reload_interval_ms(20)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    // A writer that neither renames nor writes at once: its first piece is a valid list of one.
    let whole = format!(
        "peers:\n  - {{addr: \"{}\"}}\n  - {{addr: \"{}\"}}\n",
        ups[0].addr, ups[1].addr
    );
    // Up to the end of the first entry's line.
    let first = whole.find("  - {addr").unwrap();
    let cut = first + whole[first..].find('\n').unwrap() + 1;
    let halves = || proxy.log().matches("now 1 peers").count();
    // A writer that pauses longer than the settling time (200 ms) is read half-written by
    // design; on a loaded machine the test's 40 ms pause can stretch that far, and such a
    // round says nothing. Five rounds must pause less than half of it.
    let (mut short, mut rounds) = (0, 0);
    while short < 5 {
        rounds += 1;
        assert!(
            rounds <= 20,
            "only {short} of {rounds} rounds paused under 100 ms"
        );
        let before = halves();
        use std::io::Write;
        let mut f = std::fs::File::create(&peers_file).unwrap();
        f.write_all(&whole.as_bytes()[..cut]).unwrap();
        f.flush().unwrap();
        let paused = Instant::now();
        tokio::time::sleep(Duration::from_millis(40)).await;
        f.write_all(&whole.as_bytes()[cut..]).unwrap();
        drop(f);
        // How long the file stayed half-written: until the second piece was in, not until the
        // sleep ended (a loaded machine may run the write much later).
        let paused = paused.elapsed();
        // A check, the settling time and a margin.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut two = vec![ups[0].addr_str(), ups[1].addr_str()];
        two.sort();
        assert_eq!(listed(&proxy.peers().await), two);
        if paused < Duration::from_millis(100) {
            short += 1;
            assert_eq!(
                halves(),
                before,
                "a half-written file was applied after a {paused:?} pause: {}",
                proxy.log()
            );
        }
        write_peers(&peers_file, &[(&ups[0], 1), (&ups[1], 1), (&ups[2], 1)]);
        until(&proxy, Duration::from_secs(3), |l| listed(l).len() == 3).await;
    }
}
