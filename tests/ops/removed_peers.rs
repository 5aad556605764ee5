//! A peer removed from the configuration leaves no Prometheus series behind, nor once a stream
//! it was serving ends after its removal.

use std::time::Duration;

use crate::common::*;
use crate::{find, scrape, with_label, CHAT};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_peer_leaves_no_series_behind() {
    let ups = upstreams::<2>().await;
    let dir = tempfile::tempdir().unwrap();
    let peers = dir.path().join("peers.yaml");
    std::fs::write(&peers, TestConfig::new().peers(&ups).to_yaml()).unwrap();
    let cfg = TestConfig::new().peers_file(&peers).reload_interval_ms(20);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    for i in 0..20 {
        let r = c
            .post(proxy.url(CHAT))
            .body(chat("s", &format!("c{i}"), 1, false))
            .send()
            .await
            .unwrap();
        r.bytes().await.unwrap();
    }
    let b = ups[1].addr_str();
    let m = scrape(&proxy.metrics().await);
    assert!(!find(&m, "prefixlb_peer_requests_total", &[("peer", &b)]).is_empty());
    std::fs::write(&peers, TestConfig::new().peers(&[&ups[0]]).to_yaml()).unwrap();
    let start = std::time::Instant::now();
    while proxy.peers().await["peers"].as_array().unwrap().len() != 1 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the reload did not happen"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = scrape(&proxy.metrics().await);
    let left = with_label(&m, "peer", &b);
    assert!(left.is_empty(), "series of the removed peer: {left:?}");
    assert!(!find(
        &m,
        "prefixlb_peer_requests_total",
        &[("peer", &ups[0].addr_str())]
    )
    .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_removed_mid_stream_leaves_no_series_when_the_stream_ends() {
    let ups = upstreams::<2>().await;
    let dir = tempfile::tempdir().unwrap();
    let peers = dir.path().join("peers.yaml");
    std::fs::write(&peers, TestConfig::new().peers(&[&ups[0]]).to_yaml()).unwrap();
    let cfg = TestConfig::new()
        .peers_file(&peers)
        .reload_interval_ms(20)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let a = ups[0].addr_str();
    let stream = open_stream(&proxy, 10, 100).await;
    // Removed while its stream runs, by a rename, as a peers file should be written.
    let tmp = dir.path().join("peers.tmp");
    std::fs::write(&tmp, TestConfig::new().peers(&[&ups[1]]).to_yaml()).unwrap();
    std::fs::rename(&tmp, &peers).unwrap();
    let start = std::time::Instant::now();
    while proxy.peers().await["peers"][0]["address"] != ups[1].addr_str() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the reload did not happen"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = stream.text().await.unwrap();
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "the stream was cut: {text}"
    );
    proxy.assert_idle().await;
    let m = scrape(&proxy.metrics().await);
    let left = with_label(&m, "peer", &a);
    assert!(
        left.is_empty(),
        "series of the removed peer came back: {left:?}"
    );
}
