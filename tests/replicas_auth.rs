//! Signed replica datagrams, against the real binary over loopback UDP: what is forged,
//! replayed or unsigned changes nothing and is counted, what a listed replica signs is heard
//! and steers keys, and the key file is read again on SIGHUP. The datagrams are built here by
//! hand from the format the docs give, so that the test pins the format rather than reusing
//! the code under test.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use tokio::net::UdpSocket;

const KEY_A: [u8; 32] = [0xa5; 32];
const KEY_B: [u8; 32] = [0x3c; 32];

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_keys(path: &Path, keys: &[&[u8]]) {
    let lines: Vec<String> = keys.iter().map(|k| hex(k)).collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

fn key_id(key: &[u8]) -> u8 {
    Sha256::digest(key)[0]
}

fn mac(key: &[u8]) -> Hmac<Sha256> {
    Hmac::new_from_slice(key).unwrap()
}

type Entries<'a> = &'a [(&'a str, &'a [u64])];

fn push_entries(out: &mut Vec<u8>, entries: Entries) {
    for (peer, hashes) in entries {
        out.push(peer.len() as u8);
        out.extend_from_slice(peer.as_bytes());
        out.push(hashes.len() as u8);
        for h in *hashes {
            out.extend_from_slice(&h.to_le_bytes());
        }
    }
}

/// `PLR2`, key id, sender id, sequence number, entries, HMAC-SHA256 of all that.
fn signed(key: &[u8], sender: u64, seq: u64, entries: Entries) -> Vec<u8> {
    let mut d = b"PLR2".to_vec();
    d.push(key_id(key));
    d.extend_from_slice(&sender.to_le_bytes());
    d.extend_from_slice(&seq.to_le_bytes());
    push_entries(&mut d, entries);
    let tag = mac(key).chain_update(&d).finalize().into_bytes();
    d.extend_from_slice(&tag);
    d
}

/// The format before signatures: `PLR1`, then entries.
fn unsigned(entries: Entries) -> Vec<u8> {
    let mut d = b"PLR1".to_vec();
    push_entries(&mut d, entries);
    d
}

/// What a signed datagram says.
struct Opened {
    id: u8,
    seq: u64,
    entries: Vec<(String, Vec<u64>)>,
}

/// What a signed datagram says, when its tag matches under `key`.
fn open(d: &[u8], key: &[u8]) -> Option<Opened> {
    let (body, tag) = d.split_at_checked(d.len().checked_sub(32)?)?;
    mac(key).chain_update(body).verify_slice(tag).ok()?;
    let rest = body.strip_prefix(b"PLR2")?;
    // The sender id (8 bytes after the key id) only matters to the receiver's replay window.
    let (id, seq) = (rest[0], u64::from_le_bytes(rest[9..17].try_into().unwrap()));
    let mut rest = &rest[17..];
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

async fn messages(proxy: &Proxy, event: &str) -> f64 {
    let metrics = proxy.metrics().await;
    sample(
        &metrics,
        &format!(r#"prefixlb_replica_messages_total{{event="{event}"}}"#),
    )
}

/// Waits (at most 5 s) until the proxy's `metric` reaches `n`.
async fn reaches(proxy: &Proxy, metric: &str, n: f64) {
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

async fn counted(proxy: &Proxy, event: &str, n: f64) {
    let metric = format!(r#"prefixlb_replica_messages_total{{event="{event}"}}"#);
    reaches(proxy, &metric, n).await;
}

/// Waits until the proxy hears on its replicas' port: it says so once bound.
async fn hearing(proxy: &Proxy) {
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
fn replica(listen: SocketAddr, others: &[SocketAddr]) -> Replica {
    Replica {
        listen,
        others: others.to_vec(),
    }
}

/// A proxy with one other replica, under `KEY_A`, and the socket of that other replica, at
/// its listed address.
struct Signed {
    ups: [Upstream; 2],
    _dir: tempfile::TempDir,
    keys: std::path::PathBuf,
    ours: SocketAddr,
    proxy: Proxy,
    listed: UdpSocket,
}

impl Signed {
    async fn start() -> Self {
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

/// From the listed replica's own address: a forged datagram, a replayed one, unsigned ones and
/// one under a key the file lacks are each counted and not heard; from another address, even a
/// genuine one is refused. The prompts heard count exactly the genuine datagrams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_replayed_and_unsigned_datagrams_change_nothing_and_are_counted() {
    let Signed {
        ups,
        _dir,
        keys: _,
        ours,
        proxy,
        listed,
    } = Signed::start().await;
    let peer = ups[0].addr_str();
    let told: &[(&str, &[u64])] = &[(&peer, &[11, 12, 13])];
    let sender = 0x5eed;

    let first = signed(&KEY_A, sender, 0, told);
    listed.send_to(&first, ours).await.unwrap();
    counted(&proxy, "heard", 1.0).await;

    // Every byte is under the tag: one changed in an entry's peer is forged.
    let mut forged = signed(&KEY_A, sender, 1, told);
    forged[4 + 1 + 8 + 8 + 3] ^= 0x01;
    listed.send_to(&forged, ours).await.unwrap();
    counted(&proxy, "forged", 1.0).await;
    // A tag of the right shape from a key that is not the file's.
    let mut wrong_key = signed(&KEY_B, sender, 1, told);
    wrong_key[4] = key_id(&KEY_A);
    listed.send_to(&wrong_key, ours).await.unwrap();
    counted(&proxy, "forged", 2.0).await;

    listed.send_to(&first, ours).await.unwrap();
    counted(&proxy, "replayed", 1.0).await;

    listed.send_to(&unsigned(told), ours).await.unwrap();
    counted(&proxy, "unsigned", 1.0).await;
    listed
        .send_to(&signed(&KEY_B, sender, 1, told), ours)
        .await
        .unwrap();
    counted(&proxy, "unsigned", 2.0).await;
    let mut cut = signed(&KEY_A, sender, 1, told);
    cut.truncate(4 + 1 + 8 + 8 + 31);
    listed.send_to(&cut, ours).await.unwrap();
    counted(&proxy, "unsigned", 3.0).await;

    // A genuine datagram from an address that is no replica's is refused before its tag is
    // looked at.
    let stray = std::net::UdpSocket::bind("127.0.0.2:0").unwrap();
    stray
        .send_to(&signed(&KEY_A, sender, 9, told), ours)
        .unwrap();
    counted(&proxy, "refused", 1.0).await;
    assert_eq!(
        messages(&proxy, "heard").await,
        1.0,
        "a refused datagram was heard"
    );

    // Nothing above moved the window: sequence numbers the forgeries and the stray bore are
    // heard from the replica, reordered ones too, each once.
    for seq in [9, 5, 1] {
        listed
            .send_to(&signed(&KEY_A, sender, seq, told), ours)
            .await
            .unwrap();
    }
    counted(&proxy, "heard", 4.0).await;
    listed
        .send_to(&signed(&KEY_A, sender, 5, told), ours)
        .await
        .unwrap();
    counted(&proxy, "replayed", 2.0).await;
    // Another sender (a replica restarted) counts from 0 again.
    listed
        .send_to(&signed(&KEY_A, sender + 1, 0, told), ours)
        .await
        .unwrap();
    counted(&proxy, "heard", 5.0).await;
    for (event, n) in [
        ("heard", 5.0),
        ("forged", 2.0),
        ("replayed", 2.0),
        ("unsigned", 3.0),
        ("refused", 1.0),
    ] {
        assert_eq!(messages(&proxy, event).await, n, "{event}");
    }
}

/// The long prompt of conversation `who`: its whole prefill is saved where it is cached.
fn prompt(who: &str) -> String {
    format!(
        "{who}: {}",
        "Summarise the ward's protocol: check, chart, report. ".repeat(200)
    )
}

async fn send_prompt(proxy: &Proxy, text: &str) -> String {
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
async fn next_from(socket: &UdpSocket, from: SocketAddr, key: &[u8]) -> Opened {
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

/// A scout process tells the test where it sent two prompts, in datagrams it signs as the docs
/// say. The test tells the process under test, as a listed replica, that both went to the other
/// peer: signed, that steers the prompt there; forged, the prompt goes where its key does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_datagram_steers_a_prompt_and_a_forged_one_does_not() {
    let ups = upstreams::<2>().await;
    let name_of = |addr: &str| {
        ups.iter()
            .find(|u| u.addr_str() == addr)
            .unwrap()
            .name
            .clone()
    };
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("replicas.key");
    write_keys(&keys, &[&KEY_A]);
    let addrs = replicas(3);
    let (ours, test, scouts) = (addrs[0].listen, addrs[1].listen, addrs[2].listen);
    let base = TestConfig::new().peers(&ups).replica_key_file(&keys);
    let proxy = start_proxy(&base.clone().replica(&replica(ours, &[test]))).await;
    let scout = start_proxy(&base.replica(&replica(scouts, &[test]))).await;
    let socket = UdpSocket::bind(test).await.unwrap();
    hearing(&proxy).await;
    hearing(&scout).await;

    let mut told = Vec::new();
    for (i, who) in ["forged", "signed"].into_iter().enumerate() {
        let went = send_prompt(&scout, &prompt(who)).await;
        let d = next_from(&socket, scouts, &KEY_A).await;
        assert_eq!(d.id, key_id(&KEY_A));
        assert_eq!(d.seq, i as u64, "one datagram per prompt, counted from 0");
        let (peer, hashes) = d.entries.last().unwrap().clone();
        assert_eq!(name_of(&peer), went);
        let other = ups.iter().find(|u| u.name != went).unwrap().addr_str();
        told.push((went, other, hashes));
    }
    let [(forged_home, forged_to, forged_blocks), (signed_home, signed_to, signed_blocks)] =
        <[_; 2]>::try_from(told).unwrap();

    let mut forged = signed(&KEY_A, 7, 0, &[(&forged_to, &forged_blocks)]);
    let last = forged.len() - 1;
    forged[last] ^= 0x80;
    socket.send_to(&forged, ours).await.unwrap();
    counted(&proxy, "forged", 1.0).await;
    let genuine = signed(&KEY_A, 7, 1, &[(&signed_to, &signed_blocks)]);
    socket.send_to(&genuine, ours).await.unwrap();
    counted(&proxy, "heard", 1.0).await;

    assert_eq!(
        send_prompt(&proxy, &prompt("forged")).await,
        forged_home,
        "the forged datagram moved the prompt"
    );
    assert_eq!(
        send_prompt(&proxy, &prompt("signed")).await,
        name_of(&signed_to),
        "the signed datagram did not move the prompt from {signed_home}"
    );
}

/// Writes `keys` to the key file and sends SIGHUP; returns once a read of the file counted
/// `result`. The file is also watched for changes, so a read may come before the signal.
async fn rewrite_keys(proxy: &Proxy, path: &Path, keys: &[&[u8]], result: &str) {
    let metric = reloads(result);
    let before = sample(&proxy.metrics().await, &metric);
    write_keys(path, keys);
    proxy.signal("HUP");
    reaches(proxy, &metric, before + 1.0).await;
}

fn reloads(result: &str) -> String {
    format!(r#"prefixlb_file_reloads_total{{kind="replica_keys",result="{result}"}}"#)
}

/// A rotation step by step, each step on SIGHUP: the new key beside the old, then signing, then
/// alone. A file that holds no usable key keeps the keys before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_file_is_read_again_on_sighup() {
    let Signed {
        ups,
        _dir,
        keys,
        ours,
        proxy,
        listed,
    } = Signed::start().await;
    let peer = ups[0].addr_str();
    let told: &[(&str, &[u64])] = &[(&peer, &[21, 22])];
    let send = |key: &'static [u8], sender: u64, seq: u64| {
        let d = signed(key, sender, seq, told);
        let listed = &listed;
        async move { listed.send_to(&d, ours).await.unwrap() }
    };
    assert_ne!(key_id(&KEY_A), key_id(&KEY_B));

    send(&KEY_B, 1, 0).await;
    counted(&proxy, "unsigned", 1.0).await;

    rewrite_keys(&proxy, &keys, &[&KEY_A, &KEY_B], "changed").await;
    send(&KEY_B, 1, 1).await;
    send(&KEY_A, 2, 0).await;
    counted(&proxy, "heard", 2.0).await;

    // SIGHUP reads the file even when it did not change: nothing else would now.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = sample(&proxy.metrics().await, &reloads("changed"));
    proxy.signal("HUP");
    reaches(&proxy, &reloads("changed"), before + 1.0).await;

    rewrite_keys(&proxy, &keys, &[&KEY_B, &KEY_A], "changed").await;
    send_prompt(&proxy, &prompt("rotated")).await;
    let d = next_from(&listed, ours, &KEY_B).await;
    assert_eq!(
        d.id,
        key_id(&KEY_B),
        "the proxy does not sign with the new key"
    );
    assert!(!d.entries.is_empty());

    rewrite_keys(&proxy, &keys, &[&KEY_B[..16]], "error").await;
    assert!(proxy.log().contains("too short"), "{}", proxy.log());
    send(&KEY_B, 1, 2).await;
    send(&KEY_A, 2, 1).await;
    counted(&proxy, "heard", 4.0).await;

    rewrite_keys(&proxy, &keys, &[&KEY_B], "changed").await;
    send(&KEY_A, 2, 2).await;
    counted(&proxy, "unsigned", 2.0).await;
    send(&KEY_B, 1, 3).await;
    counted(&proxy, "heard", 5.0).await;
    assert_eq!(messages(&proxy, "unsigned").await, 2.0);
}

/// `prefixlb -t` on a configuration with `replicas:`; its error output when refused.
fn check(yaml: &str) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prefixlb.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = std::process::Command::new(binary())
        .arg("-l")
        .arg(&path)
        .arg("-t")
        .output()
        .unwrap();
    match out.status.success() {
        true => Ok(()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

/// Existing loopback files keep loading without a key; off loopback a key file is required,
/// and a file of short keys, or of more than two, stops the start.
#[test]
fn replicas_off_loopback_need_a_key_file_of_long_enough_keys() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.key");
    write_keys(&good, &[&KEY_A]);
    let short = dir.path().join("short.key");
    write_keys(&short, &[&KEY_A[..31]]);
    let three = dir.path().join("three.key");
    write_keys(&three, &[&KEY_A, &KEY_B, &KEY_A]);
    let yaml = |listen: &str, other: &str, key: Option<&Path>| {
        let key = key.map_or(String::new(), |k| {
            format!(", key_file: \"{}\"", k.display())
        });
        format!(
            "peers: [{{addr: \"127.0.0.1:1\"}}]\nreplicas: {{listen: \"{listen}\", others: [\"{other}\"]{key}}}\n"
        )
    };
    let loopback = ("127.0.0.1:7300", "127.0.0.1:7301");
    assert_eq!(check(&yaml(loopback.0, loopback.1, None)), Ok(()));
    assert_eq!(check(&yaml(loopback.0, loopback.1, Some(&good))), Ok(()));
    assert_eq!(
        check(&yaml("0.0.0.0:7300", "10.0.0.2:7300", Some(&good))),
        Ok(())
    );
    for (listen, other) in [
        ("0.0.0.0:7300", "127.0.0.1:7301"),
        ("127.0.0.1:7300", "10.0.0.2:7300"),
    ] {
        let e = check(&yaml(listen, other, None)).unwrap_err();
        assert!(
            e.contains("replicas.key_file: required") && e.contains("is not loopback"),
            "{e}"
        );
    }
    let e = check(&yaml(loopback.0, loopback.1, Some(&short))).unwrap_err();
    assert!(
        e.contains("replicas.key_file") && e.contains("line 1: a key of 31 bytes is too short"),
        "{e}"
    );
    let e = check(&yaml(loopback.0, loopback.1, Some(&three))).unwrap_err();
    assert!(e.contains("holds 3 keys"), "{e}");
    let e = check(&yaml(
        loopback.0,
        loopback.1,
        Some(&dir.path().join("none.key")),
    ))
    .unwrap_err();
    assert!(e.contains("replicas.key_file"), "{e}");
}
