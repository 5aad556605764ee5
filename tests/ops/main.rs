//! What operators see: Prometheus metrics and the access log.

mod access_log;
#[path = "../common/mod.rs"]
mod common;
mod removed_peers;

use std::time::Duration;

use common::*;
use openmetrics_parser::{MetricsExposition, PrometheusType, PrometheusValue, Sample};

const CHAT: &str = "/v1/chat/completions";

type Scrape = MetricsExposition<PrometheusType, PrometheusValue>;

fn scrape(text: &str) -> Scrape {
    openmetrics_parser::prometheus::parse_prometheus(text).expect("valid Prometheus text")
}

fn value(s: &Sample<PrometheusValue>) -> f64 {
    match &s.value {
        PrometheusValue::Gauge(v) | PrometheusValue::Unknown(v) => v.as_f64(),
        PrometheusValue::Counter(c) => c.value.as_f64(),
        PrometheusValue::Histogram(h) => h.count.unwrap_or(0) as f64,
        PrometheusValue::Summary(_) => f64::NAN,
    }
}

/// The samples of `metric` whose labels include every pair in `labels`.
fn find<'a>(
    scrape: &'a Scrape,
    metric: &str,
    labels: &[(&str, &str)],
) -> Vec<&'a Sample<PrometheusValue>> {
    scrape
        .families
        .get(metric)
        .into_iter()
        .flat_map(|family| family.iter_samples())
        .filter(|s| {
            s.get_labelset()
                .is_ok_and(|l| labels.iter().all(|(k, v)| l.get_label_value(k) == Some(*v)))
        })
        .collect()
}

/// The samples of every metric that carry `label` with `value`.
fn with_label<'a>(
    scrape: &'a Scrape,
    label: &str,
    value: &str,
) -> Vec<&'a Sample<PrometheusValue>> {
    scrape
        .families
        .values()
        .flat_map(|family| family.iter_samples())
        .filter(|s| {
            s.get_labelset()
                .is_ok_and(|l| l.get_label_value(label) == Some(value))
        })
        .collect()
}

fn one(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    let found = find(scrape, metric, labels);
    assert_eq!(found.len(), 1, "{metric} {labels:?}: {found:?}");
    value(found[0])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_peer_gauges_match_the_streams_the_test_holds_open() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .max_in_flight(5)
        .balance_factor(None);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let (a, b) = (ups[0].addr_str(), ups[1].addr_str());
    // Three streams held open on a: a session whose name hashes there, its prompt then held there.
    let (mut session, mut probes) = (None, 0.0);
    for i in 0..50 {
        probes += 1.0;
        let r = c
            .post(proxy.url(CHAT))
            .header("x-session-id", format!("s{i}"))
            .body("{}")
            .send()
            .await
            .unwrap();
        if r.headers()["x-upstream"] == "a" {
            session = Some(format!("s{i}"));
            break;
        }
    }
    let session = session.expect("a session on a");
    let mut open = Vec::new();
    for _ in 0..3 {
        let r = c
            .post(proxy.url(CHAT))
            .header("x-session-id", &session)
            .header("x-mock-events", "20")
            .header("x-mock-interval-ms", "50")
            .body(chat("s", "q", 1, true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()["x-upstream"], "a");
        open.push(r);
    }
    let m = scrape(&proxy.metrics().await);
    assert_eq!(one(&m, "prefixlb_peer_in_flight", &[("peer", &a)]), 3.0);
    assert_eq!(one(&m, "prefixlb_peer_in_flight", &[("peer", &b)]), 0.0);
    assert_eq!(one(&m, "prefixlb_peer_bound", &[("peer", &a)]), 5.0);
    assert_eq!(one(&m, "prefixlb_peer_healthy", &[("peer", &a)]), 1.0);
    assert_eq!(one(&m, "prefixlb_peer_draining", &[("peer", &a)]), 0.0);
    assert_eq!(
        one(
            &m,
            "prefixlb_key_source_total",
            &[("source", "session_header")]
        ),
        probes + 3.0
    );
    assert_eq!(
        one(
            &m,
            "prefixlb_build_info",
            &[("version", env!("CARGO_PKG_VERSION"))]
        ),
        1.0
    );

    drop(open);
    proxy.wait_idle(Duration::from_secs(5)).await;
    c.post(format!("http://{}/admin/peers/{a}/drain", proxy.admin))
        .send()
        .await
        .unwrap();
    let m = scrape(&proxy.metrics().await);
    assert_eq!(one(&m, "prefixlb_peer_in_flight", &[("peer", &a)]), 0.0);
    assert_eq!(one(&m, "prefixlb_peer_draining", &[("peer", &a)]), 1.0);
    // Requests by peer, route and status class: the three streams and the probes on a.
    let on_a: f64 = find(
        &m,
        "prefixlb_peer_requests_total",
        &[("peer", &a), ("status_class", "2xx")],
    )
    .iter()
    .map(|s| value(s))
    .sum();
    let probes_on_a = ups[0].seen().len() as f64;
    assert_eq!(on_a, probes_on_a);
    assert!(
        one(
            &m,
            "prefixlb_peer_requests_total",
            &[("peer", &a), ("route", "primary"), ("status_class", "2xx")]
        ) >= 3.0
    );
    // Histograms are there with LLM-sized buckets, up to minutes.
    let duration = find(&m, "prefixlb_request_duration_seconds", &[]);
    assert!(!duration.is_empty());
    match &duration[0].value {
        PrometheusValue::Histogram(h) => {
            assert!(h.buckets.iter().any(|b| b.upper_bound == 600.0))
        }
        v => panic!("not a histogram: {v:?}"),
    }
    assert!(!find(&m, "prefixlb_upstream_first_byte_seconds", &[]).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_failures_and_reloads_are_counted() {
    let up = start_upstream("a").await;
    let (dead, _refusing) = refused_addr();
    let cfg = TestConfig::new()
        .peers_at([up.addr, dead])
        .max_in_flight(1)
        .balance_factor(None)
        .max_waiting(0)
        .no_health_check();
    let dead = dead.to_string();
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let hold = c
        .post(proxy.url(CHAT))
        .header("x-mock-events", "20")
        .header("x-mock-interval-ms", "50")
        .body(chat("s", "holder", 1, true))
        .send()
        .await
        .unwrap();
    assert_eq!(hold.status(), 200);
    // The live peer is full and the dead one refuses connects: 503 from the retry.
    let r = c
        .post(proxy.url(CHAT))
        .body(chat("s", "other", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let m = scrape(&proxy.metrics().await);
    let rejected: f64 = find(&m, "prefixlb_rejections_total", &[])
        .iter()
        .map(|s| value(s))
        .sum();
    assert!(rejected >= 1.0);
    assert!(
        one(
            &m,
            "prefixlb_peer_connect_failures_total",
            &[("peer", &dead)]
        ) >= 1.0
    );
    drop(hold);
    // A broken config file is a reload error.
    let path = proxy.config_path();
    std::fs::write(
        &path,
        format!(
            "{}\nbogus_key: 1\n",
            std::fs::read_to_string(&path).unwrap()
        ),
    )
    .unwrap();
    let start = std::time::Instant::now();
    loop {
        let m = scrape(&proxy.metrics().await);
        if find(&m, "prefixlb_reloads_total", &[("result", "error")])
            .first()
            .is_some_and(|s| value(s) >= 1.0)
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "no reload error counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Slow clients that each hold part of a body cannot take more memory than the peek budget:
/// one beyond it gets a 503, and the budget is whole again once they are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peeks_beyond_the_memory_budget_get_503() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .peek_limit_bytes(4096)
        .peek_memory_bytes(8192);
    let proxy = start_proxy(&cfg).await;
    // 3,000 bytes of a system prompt whose key is not complete yet, in a 4,000-byte body.
    let body = chat(&"s".repeat(3900), "q", 1, false);
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let memory = |m: &str| one(&scrape(m), "prefixlb_peek_memory_bytes", &[]);
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&body.as_bytes()[..3000]).await.unwrap();
        held.push(s);
        // The first holds its share before the second asks for one.
        let start = std::time::Instant::now();
        while memory(&proxy.metrics().await) < 6000.0 && start.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert_eq!(
        memory(&proxy.metrics().await),
        6000.0,
        "one peek, two copies"
    );
    let mut answer = String::new();
    held[1].read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("peek_memory_exhausted"), "{answer}");
    held[0].write_all(&body.as_bytes()[3000..]).await.unwrap();
    let mut first = vec![0u8; 4096];
    let n = held[0].read(&mut first).await.unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    drop(held);
    proxy.assert_idle().await;
    assert_eq!(memory(&proxy.metrics().await), 0.0, "the budget leaked");
    let r = client()
        .post(proxy.url(CHAT))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}
