//! What is heard steers keys: a scout process's datagrams are signed as the docs say, and a
//! signed datagram moves a prompt where a forged one does not.

use tokio::net::UdpSocket;

use crate::common::*;
use crate::{
    counted, hearing, key_id, next_from, prompt, replica, send_prompt, signed, write_keys, KEY_A,
};

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
