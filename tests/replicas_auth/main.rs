//! Signed replica datagrams, against the real binary over loopback UDP: what is forged,
//! replayed or unsigned changes nothing and is counted, what a listed replica signs is heard
//! and steers keys, and the key file is read again on SIGHUP. The datagrams are built here by
//! hand from the format the docs give, so that the test pins the format rather than reusing
//! the code under test.

#[path = "../common/mod.rs"]
mod common;

mod datagrams;
mod key_file;
mod steering;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use tokio::net::UdpSocket;

pub(crate) const KEY_A: [u8; 32] = [0xa5; 32];
pub(crate) const KEY_B: [u8; 32] = [0x3c; 32];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn write_keys(path: &Path, keys: &[&[u8]]) {
    let lines: Vec<String> = keys.iter().map(|k| hex(k)).collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

pub(crate) fn key_id(key: &[u8]) -> u8 {
    Sha256::digest(key)[0]
}

fn mac(key: &[u8]) -> Hmac<Sha256> {
    Hmac::new_from_slice(key).unwrap()
}

pub(crate) type Entries<'a> = &'a [(&'a str, &'a [u64])];

pub(crate) fn push_entries(out: &mut Vec<u8>, entries: Entries) {
    for (peer, hashes) in entries {
        out.push(peer.len() as u8);
        out.extend_from_slice(peer.as_bytes());
        out.push(hashes.len() as u8);
        for h in *hashes {
            out.extend_from_slice(&h.to_le_bytes());
        }
    }
}

/// Bytes of a signed datagram's header: `PLR3`, key id, sender id, sequence number, time sent.
pub(crate) const HEADER: usize = 4 + 1 + 8 + 8 + 8;

/// Milliseconds since the Unix epoch, now.
pub(crate) fn unix_ms() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.unwrap().as_millis() as u64
}

/// A signed datagram sent now.
pub(crate) fn signed(key: &[u8], sender: u64, seq: u64, entries: Entries) -> Vec<u8> {
    signed_at(key, sender, seq, unix_ms(), entries)
}

/// `PLR3`, key id, sender id, sequence number, the time sent (ms since the Unix epoch),
/// entries, HMAC-SHA256 of all that.
pub(crate) fn signed_at(
    key: &[u8],
    sender: u64,
    seq: u64,
    sent_ms: u64,
    entries: Entries,
) -> Vec<u8> {
    let mut d = b"PLR3".to_vec();
    d.push(key_id(key));
    d.extend_from_slice(&sender.to_le_bytes());
    d.extend_from_slice(&seq.to_le_bytes());
    d.extend_from_slice(&sent_ms.to_le_bytes());
    push_entries(&mut d, entries);
    let tag = mac(key).chain_update(&d).finalize().into_bytes();
    d.extend_from_slice(&tag);
    d
}

/// What a signed datagram says.
pub(crate) struct Opened {
    pub(crate) id: u8,
    pub(crate) seq: u64,
    pub(crate) entries: Vec<(String, Vec<u64>)>,
}

/// What a signed datagram says, when its tag matches under `key`.
fn open(d: &[u8], key: &[u8]) -> Option<Opened> {
    let (body, tag) = d.split_at_checked(d.len().checked_sub(32)?)?;
    mac(key).chain_update(body).verify_slice(tag).ok()?;
    let rest = body.strip_prefix(b"PLR3")?;
    // The sender id (8 bytes after the key id) only matters to the receiver's replay window.
    let (id, seq) = (rest[0], u64::from_le_bytes(rest[9..17].try_into().unwrap()));
    let sent_ms = u64::from_le_bytes(rest[17..25].try_into().unwrap());
    assert!(unix_ms().abs_diff(sent_ms) < 5_000, "sent at {sent_ms}");
    let mut rest = &rest[HEADER - 4..];
    let mut entries = Vec::new();
    while let Some((&n, tail)) = rest.split_first() {
        let (peer, tail) = tail.split_at(usize::from(n));
        let (&count, tail) = tail.split_first().unwrap();
        let (names, tail) = tail.split_at(8 * usize::from(count));
        let hashes = names
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        entries.push((String::from_utf8(peer.to_vec()).unwrap(), hashes));
        rest = tail;
    }
    Some(Opened { id, seq, entries })
}

pub(crate) async fn messages(proxy: &Proxy, event: &str) -> f64 {
    let metrics = proxy.metrics().await;
    sample(
        &metrics,
        &format!(r#"prefixlb_replica_messages_total{{event="{event}"}}"#),
    )
}

/// Waits (at most 5 s) until the proxy's `metric` reaches `n`.
pub(crate) async fn reaches(proxy: &Proxy, metric: &str, n: f64) {
    let start = Instant::now();
    loop {
        let now = sample(&proxy.metrics().await, metric);
        if now >= n {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{metric} stayed at {now}, short of {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) async fn counted(proxy: &Proxy, event: &str, n: f64) {
    let metric = format!(r#"prefixlb_replica_messages_total{{event="{event}"}}"#);
    reaches(proxy, &metric, n).await;
}

/// Waits until the proxy hears on its replicas' port: it says so once bound.
pub(crate) async fn hearing(proxy: &Proxy) {
    let start = Instant::now();
    while !proxy.log().contains("hearing them on udp") {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the replicas' exchange did not start: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A process on `listen` that tells `others` and hears them.
pub(crate) fn replica(listen: SocketAddr, others: &[SocketAddr]) -> Replica {
    Replica {
        listen,
        others: others.to_vec(),
    }
}

/// A proxy with one other replica, under `KEY_A`, and the socket of that other replica, at
/// its listed address.
pub(crate) struct Signed {
    pub(crate) ups: [Upstream; 2],
    pub(crate) _dir: tempfile::TempDir,
    pub(crate) keys: std::path::PathBuf,
    pub(crate) ours: SocketAddr,
    pub(crate) proxy: Proxy,
    pub(crate) listed: UdpSocket,
}

impl Signed {
    pub(crate) async fn start() -> Self {
        let ups = upstreams::<2>().await;
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("replicas.key");
        write_keys(&keys, &[&KEY_A]);
        let addrs = replicas(2);
        let (ours, theirs) = (addrs[0].listen, addrs[1].listen);
        let config = TestConfig::new()
            .peers(&ups)
            .replica(&replica(ours, &[theirs]))
            .replica_key_file(&keys);
        let proxy = start_proxy(&config).await;
        let listed = UdpSocket::bind(theirs).await.unwrap();
        hearing(&proxy).await;
        Self {
            ups,
            _dir: dir,
            keys,
            ours,
            proxy,
            listed,
        }
    }
}

/// The long prompt of conversation `who`: its whole prefill is saved where it is cached.
pub(crate) fn prompt(who: &str) -> String {
    format!(
        "{who}: {}",
        "Summarise the ward's protocol: check, chart, report. ".repeat(200)
    )
}

pub(crate) async fn send_prompt(proxy: &Proxy, text: &str) -> String {
    let body = serde_json::json!({"model": "m", "prompt": text}).to_string();
    let r = client()
        .post(proxy.url("/v1/completions"))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.headers()["x-upstream"].to_str().unwrap().to_owned()
}

/// The next datagram `socket` receives from `from`, opened under `key`.
pub(crate) async fn next_from(socket: &UdpSocket, from: SocketAddr, key: &[u8]) -> Opened {
    let mut buf = vec![0u8; 2048];
    loop {
        let (n, at) = tokio::time::timeout(Duration::from_secs(5), socket.recv_from(&mut buf))
            .await
            .expect("no datagram came")
            .unwrap();
        if at == from {
            return open(&buf[..n], key).expect("the datagram's tag does not match its key");
        }
    }
}
