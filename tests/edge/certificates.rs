//! The listener's certificate reloaded: a swapped file, and a symlink repointed as certbot
//! does, each taken by new handshakes.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::{events_in, frames, stream_headers, tls_listener, Conn};

#[tokio::test]
async fn a_swapped_certificate_serves_new_handshakes_without_dropping_an_open_stream() {
    let up = start_upstream("a").await;
    let (old, new) = (Pki::new("old ca"), Pki::new("new ca"));
    let certs = tempfile::tempdir().unwrap();
    let (cert_path, key_path, listen) = tls_listener(certs.path(), &old);
    let proxy = start_proxy(&listen.peers(&[&up])).await;
    let (mut conn, _) = Conn::open(proxy.addr, &old.ca_pem(), false).await.unwrap();
    let answer = conn
        .post(
            "/v1/chat/completions",
            &stream_headers(20, 100),
            chat("s", "q", 1, true),
        )
        .await;
    let open = tokio::spawn(frames(answer.into_body()));

    let (cert, key) = new.leaf();
    put(&cert_path, &cert);
    put(&key_path, &key);
    let start = Instant::now();
    while Conn::open(proxy.addr, &new.ca_pem(), false).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the new certificate was not taken: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        Conn::open(proxy.addr, &old.ca_pem(), false).await.is_err(),
        "a new handshake still got the old certificate"
    );
    let got = open.await.unwrap();
    assert_eq!(events_in(&got), 20, "the open stream was cut");
    assert!(proxy
        .metrics()
        .await
        .contains("prefixlb_file_reloads_total{kind=\"certificate\",result=\"changed\"} 1"));
    proxy.assert_idle().await;
}

/// Points `link` at `target` the way certbot renews `live/`: a new link renamed over the old.
fn repoint(link: &Path, target: &Path) {
    let tmp = link.with_extension("link");
    std::os::unix::fs::symlink(target, &tmp).unwrap();
    std::fs::rename(&tmp, link).unwrap();
}

#[tokio::test]
async fn a_certificate_behind_a_repointed_symlink_is_followed() {
    let up = start_upstream("a").await;
    let (old, new) = (Pki::new("old ca"), Pki::new("new ca"));
    let dir = tempfile::tempdir().unwrap();
    let (archive, live) = (dir.path().join("archive"), dir.path().join("live"));
    std::fs::create_dir_all(&archive).unwrap();
    std::fs::create_dir_all(&live).unwrap();
    let (cert_link, key_link) = (live.join("fullchain.pem"), live.join("privkey.pem"));
    for (n, pki) in [(1, &old), (2, &new)] {
        let (cert, key) = pki.leaf();
        put(&archive.join(format!("fullchain{n}.pem")), &cert);
        put(&archive.join(format!("privkey{n}.pem")), &key);
    }
    repoint(&cert_link, &archive.join("fullchain1.pem"));
    repoint(&key_link, &archive.join("privkey1.pem"));
    let proxy = start_proxy(
        &TestConfig::new()
            .listen_tls(&cert_link, &key_link)
            .peers(&[&up]),
    )
    .await;
    assert!(Conn::open(proxy.addr, &old.ca_pem(), false).await.is_ok());
    repoint(&cert_link, &archive.join("fullchain2.pem"));
    repoint(&key_link, &archive.join("privkey2.pem"));
    let start = Instant::now();
    while Conn::open(proxy.addr, &new.ca_pem(), false).await.is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the renewed link was not followed: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
