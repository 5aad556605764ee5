//! The Grafana dashboard in `conf/grafana/prefixlb.json` queries only what prefixlb exports:
//! every metric name in its queries is one the real binary's `/metrics` has, once the events
//! behind the labelled counters have happened (a request, a refused connect and its ejection,
//! a refused path, a reload, an unknown API key, a changed keys file).

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::*;

const DASHBOARD: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/conf/grafana/prefixlb.json");

/// Every `prefixlb_...` name in the dashboard's queries, as exported (a histogram's
/// `_bucket`, `_sum` and `_count` are its own name).
fn queried() -> BTreeSet<String> {
    let text = std::fs::read_to_string(DASHBOARD).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut queries = Vec::new();
    collect(&dashboard, &mut queries);
    assert!(queries.len() > 20, "{} queries", queries.len());
    let mut names = BTreeSet::new();
    for q in queries {
        let mut rest = q.as_str();
        while let Some(at) = rest.find("prefixlb_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            let name = &tail[..end];
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(name);
            names.insert(family.to_owned());
            rest = &tail[end..];
        }
    }
    names
}

/// The `expr` of every panel target and the `query` of every template variable.
fn collect(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr" | "definition", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => collect(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect(v, out)),
        _ => {}
    }
}

/// The metric families on a `/metrics` page.
fn exported(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_queries_is_exported() {
    let names = queried();
    let up = start_upstream("a").await;
    let (dead, _held) = refused_addr();
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.yaml");
    let entry = |name: &str| {
        format!(
            "keys:\n  - {{name: {name}, sha256: {}}}\n",
            sha256_hex(b"k")
        )
    };
    put(&keys, &entry("team"));
    let proxy = start_proxy(
        &TestConfig::new()
            .keys_file(&keys)
            .peers_at([up.addr, dead])
            .policy("round_robin")
            .consecutive_failures(1)
            .engine_metrics(true)
            .engine_metrics_interval_ms(100),
    )
    .await;
    let c = client();
    let post = |path: &str, key: Option<&str>| {
        let mut r = c.post(proxy.url(path)).body(chat("s", "q", 1, false));
        if let Some(key) = key {
            r = r.header("authorization", format!("Bearer {key}"));
        }
        r.send()
    };
    // Round robin: one of these meets the refused peer, which is ejected; the retry succeeds.
    for _ in 0..4 {
        assert_eq!(
            post("/v1/chat/completions", Some("k"))
                .await
                .unwrap()
                .status(),
            200
        );
    }
    assert_eq!(post("/v1/nowhere", Some("k")).await.unwrap().status(), 404);
    assert_eq!(
        post("/v1/chat/completions", None).await.unwrap().status(),
        401
    );
    proxy.signal("HUP");
    put(&keys, &entry("renamed"));
    let start = Instant::now();
    let missing = loop {
        let have = exported(&proxy.metrics().await);
        let missing: Vec<&String> = names.iter().filter(|n| !have.contains(*n)).collect();
        if missing.is_empty() || start.elapsed() > Duration::from_secs(10) {
            break missing.into_iter().cloned().collect::<Vec<_>>();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(missing.is_empty(), "queried but not exported: {missing:?}");
    proxy.assert_idle().await;
}
