//! What is not heard: forged, replayed, stale and unsigned datagrams from the listed replica,
//! and a genuine one from an address that is no replica's, each counted; the window they leave.

use crate::{
    counted, key_id, messages, push_entries, signed, signed_at, unix_ms, Entries, Signed, HEADER,
    KEY_A, KEY_B,
};

/// The format before signatures: `PLR1`, then entries.
fn unsigned(entries: Entries) -> Vec<u8> {
    let mut d = b"PLR1".to_vec();
    push_entries(&mut d, entries);
    d
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
    forged[HEADER + 3] ^= 0x01;
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
    cut.truncate(HEADER + 31);
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

    // A genuine datagram sent a minute ago (a copy kept for when its sender is forgotten, or
    // this process restarted), or dated a minute ahead, is stale: no window remembers every
    // sender, the time does. It moves no window either.
    let stale = sender + 2;
    for sent in [unix_ms() - 60_000, unix_ms() + 60_000] {
        listed
            .send_to(&signed_at(&KEY_A, stale, 0, sent, told), ours)
            .await
            .unwrap();
    }
    counted(&proxy, "stale", 2.0).await;
    listed
        .send_to(&signed(&KEY_A, stale, 0, told), ours)
        .await
        .unwrap();
    counted(&proxy, "heard", 6.0).await;
    for (event, n) in [
        ("heard", 6.0),
        ("stale", 2.0),
        ("forged", 2.0),
        ("replayed", 2.0),
        ("unsigned", 3.0),
        ("refused", 1.0),
    ] {
        assert_eq!(messages(&proxy, event).await, n, "{event}");
    }
}
