//! The admin API: draining a peer through it, and the bearer token that guards it.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::{conversation_on, peer, served_by, until, CHAT};

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
    assert_eq!(denied.headers()["www-authenticate"], "Bearer");
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

/// An endpoint asked with the wrong method says which it takes; without a token, a request
/// whose Host is a name (which its owner's page could point at the listener) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_methods_get_405_and_a_named_host_is_refused_without_a_token() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let c = client();
    let base = format!("http://{}", proxy.admin);
    for (method, path, allow) in [
        (
            reqwest::Method::GET,
            format!("/admin/peers/{}/drain", up.addr),
            "POST",
        ),
        (reqwest::Method::POST, "/admin/peers".to_owned(), "GET"),
        (reqwest::Method::DELETE, "/metrics".to_owned(), "GET"),
    ] {
        let r = c
            .request(method.clone(), format!("{base}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 405, "{method} {path}");
        assert_eq!(r.headers()["allow"], allow);
        let body: serde_json::Value = r.json().await.unwrap();
        assert!(body["error"]["message"].is_string());
    }
    let peers = format!("{base}/admin/peers");
    for (host, status) in [
        ("evil.example", 403),
        ("localhost", 200),
        (proxy.admin.to_string().as_str(), 200),
    ] {
        let r = c.get(&peers).header("host", host).send().await.unwrap();
        assert_eq!(r.status(), status, "{host}");
    }
    assert_eq!(
        peer(&proxy.peers().await, &up.addr_str())["draining"],
        false
    );
}
