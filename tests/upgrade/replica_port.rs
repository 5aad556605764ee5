//! The replicas' UDP port across an upgrade: the new process binds it beside the old one and
//! hears the other replicas.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::{loopback, spawn, start_first, took_over};

/// The replicas' UDP port is shared across an upgrade: the new process binds it while the old
/// one still holds it, and hears what another replica tells once the old one is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_process_hears_the_other_replicas() {
    let ups = upstreams::<2>().await;
    let peers = TestConfig::new().peers(&ups);
    let told = replicas(2);
    let sibling = start_proxy(&peers.clone().replica(&told[1])).await;
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (free_port(), free_port());
    let old = start_first(
        dir.path(),
        port,
        peers
            .admin_on(loopback(admin))
            .no_health_check()
            .engine_metrics(false)
            .replica(&told[0]),
    )
    .await;
    let new = spawn(dir.path(), "p1", true);
    send_signal(old.id(), "QUIT");
    took_over(dir.path(), "p1").await;
    drop(old);
    let heard = || async {
        let metrics = reqwest::get(format!("http://127.0.0.1:{admin}/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        sample(
            &metrics,
            r#"prefixlb_replica_messages_total{event="heard"}"#,
        )
    };
    let c = client();
    let start = Instant::now();
    let mut conversation = 0;
    while heard().await < 1.0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the new process heard nothing"
        );
        // Each new conversation is recorded, and told, by the sibling.
        conversation += 1;
        let body = chat(&"s".repeat(3000), &format!("q{conversation}"), 1, false);
        let r = c
            .post(sibling.url("/v1/chat/completions"))
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = std::fs::read_to_string(dir.path().join("p1.log")).unwrap();
    assert!(
        !log.contains("cannot listen"),
        "the new process could not bind the replicas' port while the old one held it: {log}"
    );
    drop(new);
}
