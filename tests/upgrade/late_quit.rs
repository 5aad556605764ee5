//! A successor whose predecessor is told to hand over late still shares the in-flight counts
//! with it while both serve.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::{spawn, start_first, took_over};

/// The old process is told two seconds after the new one started, longer than a sharing
/// process stays alone in the shared file before it routes alone: the new one still takes
/// part once it has the sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successor_told_late_shares_the_counts_with_the_old_process() {
    let up = start_upstream("a").await;
    let dir = tempfile::tempdir().unwrap();
    let lb = TestConfig::new().peers(&[&up]).no_admin().no_health_check();
    let old = start_first(dir.path(), free_port(), lb).await;
    let new = spawn(dir.path(), "p1", true);
    tokio::time::sleep(Duration::from_secs(2)).await;
    send_signal(old.id(), "QUIT");
    took_over(dir.path(), "p1").await;
    let shared = dir.path().join("prefixlb.inflight");
    let start = Instant::now();
    loop {
        let table = std::fs::read_to_string(&shared).unwrap_or_default();
        if table.contains(&format!("\"{}\"", new.id())) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(4),
            "the new process never shared its counts: {table}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
