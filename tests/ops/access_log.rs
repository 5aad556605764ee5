//! The access log: a JSON line per request, with what routed it and what it took, and none of
//! the prompt's text.

use std::time::Duration;

use crate::common::*;
use crate::CHAT;

/// Sends a chat whose prompt names a patient ("Jane"), which no log may hold.
async fn ask_about_jane(c: &reqwest::Client, proxy: &Proxy) {
    let secret = "patient Jane Doe, date of birth 1970-01-01";
    let r = c
        .post(proxy.url(CHAT))
        .body(chat("sys", secret, 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_a_line_per_request_and_no_prompt_text() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new().peers(&[&up]).access_log("json");
    let proxy = start_proxy(&cfg).await;
    let c = client();
    for _ in 0..3 {
        ask_about_jane(&c, &proxy).await;
    }
    let r = c.get(proxy.url("/v1/models")).send().await.unwrap();
    r.bytes().await.unwrap();
    let start = std::time::Instant::now();
    let lines = loop {
        let log = proxy.access_log();
        let lines: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str(l).expect("a JSON line"))
            .collect();
        if lines.len() >= 4 || start.elapsed() > Duration::from_secs(5) {
            assert!(
                !log.contains("Jane"),
                "the prompt leaked into the access log"
            );
            break lines;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(lines.len(), 4);
    let chat_line = &lines[0];
    assert_eq!(chat_line["method"], "POST");
    assert_eq!(chat_line["path"], CHAT);
    assert_eq!(chat_line["status"], 200);
    assert_eq!(chat_line["peer"], up.addr_str());
    assert_eq!(chat_line["route"], "primary");
    assert_eq!(chat_line["key_source"], "chat");
    assert_eq!(chat_line["key_hash"].as_str().unwrap().len(), 16);
    assert!(chat_line["bytes_in"].as_u64().unwrap() > 50);
    assert!(chat_line["bytes_out"].as_u64().unwrap() > 10);
    assert!(chat_line["ttft_ms"].is_u64() && chat_line["duration_ms"].is_u64());
    assert!(chat_line["time"].as_str().unwrap().ends_with('Z'));
    // Same conversation, same key.
    assert_eq!(lines[1]["key_hash"], chat_line["key_hash"]);
    assert_eq!(lines[3]["key_source"], "client_addr");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_debug_level_each_decision_says_what_it_priced() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new().peers(&ups);
    let proxy = start_proxy_adjusted(&cfg, &PingoraConfig::new(), |c| {
        c.env(
            "RUST_LOG",
            "info,prefixlb::routing::policy::least_cost=debug",
        );
    })
    .await;
    ask_about_jane(&client(), &proxy).await;
    let start = std::time::Instant::now();
    let line = loop {
        let log = proxy.log();
        if let Some(line) = log.lines().find(|l| l.contains("least_cost chose")) {
            break line.to_owned();
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no decision: {log}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!proxy.log().contains("Jane"), "the prompt leaked: {line}");
    // Both peers priced (a key's first three of two), with what they were priced on.
    for up in &ups {
        let priced = format!(" {}: cost_ms=", up.addr_str());
        assert!(
            line.contains(&priced),
            "{} not priced: {line}",
            up.addr_str()
        );
    }
    assert!(
        ups.iter()
            .any(|u| line.contains(&format!("chose {} (home", u.addr_str()))),
        "{line}"
    );
    assert!(
        line.contains("load=0/0") && line.contains("rate=10000"),
        "{line}"
    );
}
