//! The key file: read again on SIGHUP through a rotation (a file without a usable key keeps the
//! keys before it), and required, of long enough keys, for replicas off loopback.

use std::path::Path;
use std::time::Duration;

use crate::common::*;
use crate::{
    counted, key_id, messages, next_from, prompt, reaches, send_prompt, signed, write_keys, Signed,
    KEY_A, KEY_B,
};

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
