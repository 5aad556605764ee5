//! The control plane through the real binary: health checks, ejection, hot reload, drain and
//! DNS discovery.

mod admin;
#[path = "../common/mod.rs"]
mod common;
mod discovery;
mod ejection;
mod health;
mod load;
mod reload;

use std::time::{Duration, Instant};

use common::*;

pub(crate) const CHAT: &str = "/v1/chat/completions";

async fn ask(c: &reqwest::Client, proxy: &Proxy, conversation: &str) -> reqwest::Response {
    c.post(proxy.url(CHAT))
        .body(chat("sys", conversation, 1, false))
        .send()
        .await
        .unwrap()
}

pub(crate) async fn served_by(c: &reqwest::Client, proxy: &Proxy, conversation: &str) -> String {
    let r = ask(c, proxy, conversation).await;
    assert_eq!(r.status(), 200, "{}", proxy.log());
    let upstream = r.headers()["x-upstream"].to_str().unwrap().to_owned();
    r.bytes().await.unwrap();
    upstream
}

pub(crate) fn peer<'a>(listing: &'a serde_json::Value, addr: &str) -> &'a serde_json::Value {
    listing["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["address"] == addr)
        .unwrap_or_else(|| panic!("{addr} not listed: {listing}"))
}

/// Polls the admin listing until `pred` holds, at most `limit`; returns how long it took.
pub(crate) async fn until(
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
pub(crate) async fn conversation_on(c: &reqwest::Client, proxy: &Proxy, home: &str) -> String {
    for i in 0..200 {
        let conv = format!("conversation {i}");
        if served_by(c, proxy, &conv).await == home {
            return conv;
        }
    }
    panic!("no conversation maps to {home}");
}

pub(crate) fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
    v.sort();
    v
}

/// The peer addresses of an admin listing, sorted.
pub(crate) fn listed(l: &serde_json::Value) -> Vec<String> {
    sorted(
        l["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["address"].as_str().unwrap().to_owned())
            .collect(),
    )
}
