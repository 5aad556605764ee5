//! Active health checks: a peer whose checks fail, or that is killed, goes down and passes its
//! keys on; one that answers again gets them back.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::common::*;
use crate::{conversation_on, peer, served_by, until};

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
