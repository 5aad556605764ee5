//! A successor whose predecessor is told to hand over late still shares the in-flight counts
//! with it while both serve.

use std::time::Duration;

use crate::common::*;
use crate::{loopback, spawn, start_first, took_over};

/// The old process is told two seconds after the new one started, longer than a sharing
/// process stays alone in the shared file before it routes alone (one second): while the old
/// one still serves a stream, both are in the file, past that second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_told_late_shares_the_counts_with_the_old_process() {
    let up = start_upstream("a").await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let lb = TestConfig::new().peers(&[&up]).no_admin().no_health_check();
    let old = start_first(dir.path(), port, lb).await;
    // A stream of eight seconds keeps the old process serving after the handover.
    let url = format!("http://{}/v1/chat/completions", loopback(port));
    let stream = open_stream_at(&url, 80, 100).await;
    assert_eq!(stream.status(), 200);
    let new = spawn(dir.path(), "p1", true);
    tokio::time::sleep(Duration::from_secs(2)).await;
    send_signal(old.id(), "QUIT");
    took_over(dir.path(), "p1").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let table = std::fs::read_to_string(dir.path().join("prefixlb.inflight")).unwrap_or_default();
    for pid in [old.id(), new.id()] {
        assert!(
            table.contains(&format!("\"{pid}\"")),
            "{pid} not sharing: {table}"
        );
    }
    let body = stream.text().await.unwrap();
    assert!(
        body.ends_with("data: [DONE]\n\n"),
        "the stream was cut: {body}"
    );
}
