//! TLS to engines: a peer behind TLS is reached and health-checked, and refused when its
//! certificate is not trusted.

use std::time::{Duration, Instant};

use crate::common::*;

#[tokio::test]
async fn a_peer_behind_tls_is_reached_checked_and_refused_when_untrusted() {
    let pki = Pki::new("engine ca");
    let (cert, key) = pki.leaf();
    let up = start_tls_upstream("tls-engine", &cert, &key).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    put(&ca_file, &pki.ca_pem());
    let peer = TestConfig::new()
        .peer(PeerEntry::at(up.addr).tls("localhost"))
        .health_check_interval_ms(100);
    let trusted = start_proxy(&peer.clone().upstream_ca_file(&ca_file)).await;
    let answer = client()
        .post(trusted.url("/v1/chat/completions"))
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["x-upstream"], "tls-engine");
    // Health checks reach it over TLS too.
    let start = Instant::now();
    while up.health_checks.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "no health check");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listing = trusted.peers().await;
    assert_eq!(listing["peers"][0]["healthy"], true);
    assert_eq!(listing["peers"][0]["tls"], "localhost");

    // Without the CA the engine's certificate is not trusted: nothing reaches it.
    let untrusted = start_proxy(&peer).await;
    let answer = client()
        .post(untrusted.url("/v1/chat/completions"))
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    assert!(
        matches!(answer.status().as_u16(), 502 | 503),
        "{}",
        answer.status()
    );
    assert_eq!(up.seen().len(), 1);
    trusted.assert_idle().await;
    untrusted.assert_idle().await;
}
