//! The control plane through the real binary: health checks, ejection, hot reload, drain and
//! DNS discovery.

mod common;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::dns::*;
use common::*;
use futures_util::StreamExt;

const CHAT: &str = "/v1/chat/completions";

async fn ask(c: &reqwest::Client, proxy: &Proxy, conversation: &str) -> reqwest::Response {
    c.post(proxy.url(CHAT))
        .body(chat("sys", conversation, 1, false))
        .send()
        .await
        .unwrap()
}

async fn served_by(c: &reqwest::Client, proxy: &Proxy, conversation: &str) -> String {
    let r = ask(c, proxy, conversation).await;
    assert_eq!(r.status(), 200, "{}", proxy.log());
    let upstream = r.headers()["x-upstream"].to_str().unwrap().to_owned();
    r.bytes().await.unwrap();
    upstream
}

fn peer<'a>(listing: &'a serde_json::Value, addr: &str) -> &'a serde_json::Value {
    listing["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["address"] == addr)
        .unwrap_or_else(|| panic!("{addr} not listed: {listing}"))
}

/// Polls the admin listing until `pred` holds, at most `limit`; returns how long it took.
async fn until(
    proxy: &Proxy,
    limit: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let listing = proxy.peers().await;
        if pred(&listing) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "condition not met in {limit:?}: {listing}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A conversation whose primary is `home`.
async fn conversation_on(c: &reqwest::Client, proxy: &Proxy, home: &str) -> String {
    for i in 0..200 {
        let conv = format!("conversation {i}");
        if served_by(c, proxy, &conv).await == home {
            return conv;
        }
    }
    panic!("no conversation maps to {home}");
}

/// `peers` checked for health every 200 ms, each check deciding.
fn fast_health(peers: TestConfig) -> TestConfig {
    peers
        .health_check_interval_ms(200)
        .health_check_timeout_ms(200)
        .healthy_after(1)
        .unhealthy_after(1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_peer_is_marked_down_within_one_interval_and_gets_its_keys_back() {
    let ups = upstreams::<3>().await;
    let cfg = fast_health(TestConfig::new().peers(&ups));
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let conv = conversation_on(&c, &proxy, "a").await;
    let a = ups[0].addr_str();

    // /health starts failing: down within one interval plus the timeout.
    ups[0].healthy.store(false, Ordering::SeqCst);
    let took = until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a)["healthy"] == false
    })
    .await;
    assert!(
        took <= Duration::from_millis(200 + 200 + 150),
        "marked down after {took:?}"
    );
    let before = ups[0].seen().len();
    for i in 0..30 {
        assert_ne!(served_by(&c, &proxy, &conv).await, "a");
        let _ = served_by(&c, &proxy, &format!("other {i}")).await;
    }
    assert_eq!(
        ups[0].seen().len(),
        before,
        "a peer marked down got requests"
    );

    ups[0].healthy.store(true, Ordering::SeqCst);
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a)["healthy"] == true
    })
    .await;
    assert_eq!(
        served_by(&c, &proxy, &conv).await,
        "a",
        "its keys did not come back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_peer_goes_down_and_a_restarted_one_comes_back() {
    let a = start_upstream("a").await;
    let b = start_upstream("b").await;
    let a_addr = a.addr;
    let cfg = fast_health(TestConfig::new().peers(&[&a, &b]));
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let conv = conversation_on(&c, &proxy, "a").await;
    drop(a);
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a_addr.to_string())["healthy"] == false
    })
    .await;
    for _ in 0..10 {
        assert_eq!(served_by(&c, &proxy, &conv).await, "b");
    }
    let listener = tokio::net::TcpListener::bind(a_addr).await.unwrap();
    let _a = start_upstream_on("a", listener).await;
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a_addr.to_string())["healthy"] == true
    })
    .await;
    assert_eq!(served_by(&c, &proxy, &conv).await, "a");
}

/// A request in `conversation` that the mock engine answers with `status`; returns the status
/// the client got.
async fn answered_with(
    c: &reqwest::Client,
    proxy: &Proxy,
    conversation: &str,
    status: u16,
) -> reqwest::StatusCode {
    c.post(proxy.url(CHAT))
        .header("x-mock-status", status.to_string())
        .body(chat("sys", conversation, 1, false))
        .send()
        .await
        .unwrap()
        .status()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_gateway_errors_eject_a_peer_but_4xx_and_500_do_not() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .no_health_check()
        .consecutive_failures(3)
        .ejection_ms(1500, 10000);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let conv = conversation_on(&c, &proxy, "a").await;
    let a = ups[0].addr_str();
    // A client that aims requests the engine refuses, or chokes on, at one session.
    for status in [400, 500] {
        for _ in 0..10 {
            assert_eq!(answered_with(&c, &proxy, &conv, status).await, status);
        }
        assert_eq!(
            peer(&proxy.peers().await, &a)["ejected"],
            false,
            "{status} answers ejected the peer"
        );
    }
    for _ in 0..3 {
        assert_eq!(answered_with(&c, &proxy, &conv, 503).await, 503);
    }
    assert_eq!(peer(&proxy.peers().await, &a)["ejected"], true);
    assert_eq!(
        served_by(&c, &proxy, &conv).await,
        "b",
        "an ejected peer got a request"
    );
    // After the backoff the peer is tried again, and a success restores it.
    until(&proxy, Duration::from_secs(4), |l| {
        peer(l, &a)["ejected"] == false
    })
    .await;
    assert_eq!(served_by(&c, &proxy, &conv).await, "a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_everywhere_eject_no_more_than_the_cap() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .no_health_check()
        .consecutive_failures(2)
        .ejection_ms(10000, 10000)
        .max_ejected_percent(50);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    // Every engine answers 503, to every conversation.
    for i in 0..30 {
        let status = answered_with(&c, &proxy, &format!("c{i}"), 503).await;
        assert_eq!(status, 503, "request {i} found no peer to fail on");
    }
    let listing = proxy.peers().await;
    let ejected = listing["peers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["ejected"] == true)
        .count();
    assert_eq!(ejected, 1, "half of two peers is one: {listing}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_takes_a_peer_whose_ejection_ran_out_without_health_checks() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .max_in_flight(1)
        .no_health_check()
        .reload_interval_ms(50)
        .consecutive_failures(2)
        .ejection_ms(400, 400)
        .max_waiting(4)
        .queue_timeout_ms(10000);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let conv = conversation_on(&c, &proxy, "a").await;
    for _ in 0..2 {
        assert_eq!(answered_with(&c, &proxy, &conv, 502).await, 502);
    }
    assert_eq!(
        peer(&proxy.peers().await, &ups[0].addr_str())["ejected"],
        true
    );
    // b's one slot is taken for 3 s; a is out for 400 ms.
    let held = open_stream(&proxy, 30, 100).await;
    let start = Instant::now();
    let r = c
        .post(proxy.url(CHAT))
        .body(chat("sys", &conv, 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        start.elapsed() < Duration::from_millis(1500),
        "the waiter waited {:?}: nobody told it a was back",
        start.elapsed()
    );
    drop(held);
}

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
async fn a_drained_peer_takes_nothing_new_and_its_in_flight_falls_to_zero() {
    let ups = upstreams::<2>().await;
    // No balance bound, so that three streams of one conversation all stay on its peer.
    let cfg = TestConfig::new().peers(&ups).balance_factor(None);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let conv = conversation_on(&c, &proxy, "a").await;
    let a = ups[0].addr_str();
    let mut streams = Vec::new();
    for _ in 0..3 {
        let r = c
            .post(proxy.url(CHAT))
            .header("x-mock-events", "10")
            .header("x-mock-interval-ms", "40")
            .body(chat("sys", &conv, 1, true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()["x-upstream"], "a");
        streams.push(r);
    }
    let drained: serde_json::Value = c
        .post(format!("http://{}/admin/peers/{a}/drain", proxy.admin))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(peer(&drained, &a)["draining"], true);
    assert_eq!(peer(&drained, &a)["in_flight"], 3);
    assert_eq!(
        served_by(&c, &proxy, &conv).await,
        "b",
        "a draining peer took a request"
    );
    for s in streams {
        let text = s.text().await.unwrap();
        assert!(
            text.ends_with("data: [DONE]\n\n"),
            "a drain cut an open stream"
        );
    }
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a)["in_flight"] == 0
    })
    .await;
    let r = c
        .post(format!("http://{}/admin/peers/{a}/undrain", proxy.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(served_by(&c, &proxy, &conv).await, "a");
    let missing = c
        .post(format!(
            "http://{}/admin/peers/10.9.9.9:1/drain",
            proxy.admin
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_can_require_a_bearer_token() {
    let up = start_upstream("a").await;
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_addr(), free_addr());
    let path = dir.path().join("lb.yaml");
    let config = TestConfig::new()
        .listen_on(listen)
        .admin_on(admin)
        .admin_token("s3cret")
        .peers(&[&up]);
    std::fs::write(&path, config.to_yaml()).unwrap();
    let mut child = std::process::Command::new(binary())
        .arg("-l")
        .arg(&path)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://{admin}/admin/peers");
    let c = client();
    let start = Instant::now();
    let denied = loop {
        if let Ok(r) = c.get(&url).send().await {
            break r;
        }
        assert!(start.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(denied.status(), 401);
    let allowed = c.get(&url).bearer_auth("s3cret").send().await.unwrap();
    assert_eq!(allowed.status(), 200);
    for (auth, status) in [
        ("bearer s3cret", 200),
        ("BEARER s3cret", 200),
        ("Bearer s3cre", 401),
        ("Bearer s3cret2", 401),
        ("Basic s3cret", 401),
    ] {
        let r = c
            .get(&url)
            .header("authorization", auth)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{auth}");
    }
    // What a web page could make a browser send is refused; a tool's plain POST is not.
    let drain = format!("http://{admin}/admin/peers/{}/drain", up.addr);
    let undrain = drain.replace("/drain", "/undrain");
    let from_page = [
        ("origin", "http://evil.example"),
        ("content-type", "text/plain"),
        ("content-type", "application/x-www-form-urlencoded"),
        ("content-type", "multipart/form-data; boundary=x"),
    ];
    for (name, value) in from_page {
        let r = c
            .post(&drain)
            .bearer_auth("s3cret")
            .header(name, value)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{name}: {value}");
    }
    let listing = c.get(&url).bearer_auth("s3cret").send().await.unwrap();
    let listing: serde_json::Value = listing.json().await.unwrap();
    assert_eq!(
        listing["peers"][0]["draining"], false,
        "a refused call changed something"
    );
    let r = c.post(&drain).bearer_auth("s3cret").send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(&undrain)
        .bearer_auth("s3cret")
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_discovery_follows_the_records() {
    let (port, [a, b, c3]) = upstreams_on_one_port::<3>().await;
    let answers = Arc::new(Mutex::new(vec![
        Ipv4Addr::new(127, 0, 0, 1),
        Ipv4Addr::new(127, 0, 0, 2),
    ]));
    let dns = fake_dns(a_records("gpu.test.", Arc::clone(&answers))).await;
    let cfg = TestConfig::new()
        .dns("gpu.test.", dns.addr)
        .dns_port(port)
        .dns_interval_ms(100)
        .dns_max_in_flight(8);
    let proxy = start_proxy(&cfg).await;
    let listed = |l: &serde_json::Value| -> Vec<String> {
        let mut v: Vec<String> = l["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["address"].as_str().unwrap().to_owned())
            .collect();
        v.sort();
        v
    };
    until(&proxy, Duration::from_secs(5), |l| {
        listed(l) == vec![a.addr_str(), b.addr_str()]
    })
    .await;
    assert_eq!(
        peer(&proxy.peers().await, &a.addr_str())["max_in_flight"],
        8
    );

    *answers.lock().unwrap() = vec![Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)];
    until(&proxy, Duration::from_secs(5), |l| {
        listed(l) == vec![b.addr_str(), c3.addr_str()]
    })
    .await;
    let c = client();
    let mut served = std::collections::HashSet::new();
    for i in 0..30 {
        served.insert(served_by(&c, &proxy, &format!("k{i}")).await);
    }
    assert!(
        !served.contains("a"),
        "a peer gone from DNS still got requests"
    );
    assert_eq!(served.len(), 2);
}

fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
    v.sort();
    v
}

/// The peer addresses of an admin listing, sorted.
fn listed(l: &serde_json::Value) -> Vec<String> {
    sorted(
        l["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["address"].as_str().unwrap().to_owned())
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_srv_target_that_fails_once_keeps_its_peer_and_one_that_stays_gone_leaves() {
    use hickory_proto::rr::{rdata::SRV, Name, RData, RecordType};
    let (port, [a, b]) = upstreams_on_one_port::<2>().await;
    // Targets whose address lookups fail right now.
    let failing = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let down = Arc::clone(&failing);
    let dns = fake_dns(Box::new(move |q| {
        let name = q.name().to_lowercase().to_ascii();
        match (q.query_type(), name.as_str()) {
            (RecordType::SRV, "gpu.test.") => ["t1.test.", "t2.test."]
                .iter()
                .map(|t| RData::SRV(SRV::new(0, 1, port, Name::from_ascii(t).unwrap())))
                .collect(),
            (RecordType::A, t @ ("t1.test." | "t2.test."))
                if !down.lock().unwrap().contains(&t) =>
            {
                let last = if t == "t1.test." { 1 } else { 2 };
                vec![RData::A(hickory_proto::rr::rdata::A(Ipv4Addr::new(
                    127, 0, 0, last,
                )))]
            }
            _ => Vec::new(),
        }
    }))
    .await;
    let cfg = TestConfig::new()
        .dns("gpu.test.", dns.addr)
        .dns_srv()
        .dns_interval_ms(100)
        .dns_failures_before_removal(3)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let both = vec![a.addr_str(), b.addr_str()];
    until(&proxy, Duration::from_secs(5), |l| listed(l) == both).await;
    // One failed round (well under three intervals): the peer never leaves.
    failing.lock().unwrap().push("t2.test.");
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(150) {
        assert_eq!(
            listed(&proxy.peers().await),
            both,
            "one failed lookup moved keys"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    failing.lock().unwrap().clear();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(listed(&proxy.peers().await), both);
    // A target that stays gone leaves after three failed rounds.
    failing.lock().unwrap().push("t2.test.");
    until(&proxy, Duration::from_secs(5), |l| {
        listed(l) == vec![a.addr_str()]
    })
    .await;
    assert!(
        proxy.log().contains("keeping its last addresses"),
        "{}",
        proxy.log()
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

/// An engine whose metrics report a queue gets no new requests while the queue lasts (what it
/// has beyond this process's requests counts as load), and its keys come back once it clears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_reporting_a_queue_is_passed_over_until_it_clears() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .no_health_check()
        .engine_metrics(true)
        .engine_metrics_interval_ms(50);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let conv = conversation_on(&c, &proxy, "a").await;
    let a = ups[0].addr_str();
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a)["engine"]["waiting"] == 0
    })
    .await;
    ups[0].engine_waiting.store(20, Ordering::SeqCst);
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a)["external"] == 20 && peer(l, &a)["engine"]["waiting"] == 20
    })
    .await;
    for _ in 0..3 {
        assert_eq!(served_by(&c, &proxy, &conv).await, "b", "sent into a queue");
    }
    ups[0].engine_waiting.store(0, Ordering::SeqCst);
    until(&proxy, Duration::from_secs(3), |l| {
        peer(l, &a)["external"] == 0
    })
    .await;
    assert_eq!(served_by(&c, &proxy, &conv).await, "a");
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("prefixlb_peer_engine_waiting{peer=\""),
        "{metrics}"
    );
}

/// A prompt is priced whether its key comes from the body or from a session header: until the
/// engine's first byte its uncached share counts on the peer's prefill queue, as
/// `/admin/peers` shows, and the first byte gives it back. A prompt read from the body that no
/// peer holds counts whole; one known by its session header alone counts all but the newest
/// turn as cached on its own peer (the record cannot say what that peer holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_counts_on_its_peers_prefill_queue_until_the_first_byte() {
    let ups = upstreams::<1>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let body = chat("system", &"x".repeat(40_000), 1, false);
    let tokens = (body.len() / prefixlb::routing::Tuning::DEFAULT.chars_per_token as usize) as f64;
    let turn = (tokens * (1.0 - prefixlb::routing::Tuning::DEFAULT.warm_hit)).ceil() as u64;
    let a = ups[0].addr_str();
    for (session, expected) in [(None, tokens as u64), (Some("s-1"), turn)] {
        let mut req = c
            .post(proxy.url("/v1/chat/completions"))
            .header("x-mock-delay-ms", "1000")
            .body(body.clone());
        if let Some(id) = session {
            req = req.header("x-session-id", id);
        }
        let pending = tokio::spawn(req.send());
        until(&proxy, Duration::from_secs(3), |l| {
            peer(l, &a)["prefill_queue_tokens"] == expected
        })
        .await;
        assert_eq!(pending.await.unwrap().unwrap().status(), 200);
        let listing = proxy.wait_idle(Duration::from_secs(3)).await;
        assert_eq!(peer(&listing, &a)["prefill_queue_tokens"], 0, "{session:?}");
    }
}
