//! DNS discovery: peers follow the A records of a name, and SRV targets whose lookups fail
//! stay until they have failed several rounds.

use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::dns::*;
use crate::common::*;
use crate::{listed, peer, served_by, until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_discovery_follows_the_records() {
    let (port, [a, b, c3]) = upstreams_on_one_port::<3>().await;
    let answers = Arc::new(Mutex::new(vec![
        Ipv4Addr::new(127, 0, 0, 1),
        Ipv4Addr::new(127, 0, 0, 2),
    ]));
    let dns = fake_dns(a_records("gpu.test.", Arc::clone(&answers))).await;
    let cfg = TestConfig::new()
        .dns("gpu.test.", dns.addr)
        .dns_port(port)
        .dns_interval_ms(100)
        .dns_max_in_flight(8);
    let proxy = start_proxy(&cfg).await;
    let listed = |l: &serde_json::Value| -> Vec<String> {
        let mut v: Vec<String> = l["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["address"].as_str().unwrap().to_owned())
            .collect();
        v.sort();
        v
    };
    until(&proxy, Duration::from_secs(5), |l| {
        listed(l) == vec![a.addr_str(), b.addr_str()]
    })
    .await;
    assert_eq!(
        peer(&proxy.peers().await, &a.addr_str())["max_in_flight"],
        8
    );

    *answers.lock().unwrap() = vec![Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)];
    until(&proxy, Duration::from_secs(5), |l| {
        listed(l) == vec![b.addr_str(), c3.addr_str()]
    })
    .await;
    let c = client();
    let mut served = std::collections::HashSet::new();
    for i in 0..30 {
        served.insert(served_by(&c, &proxy, &format!("k{i}")).await);
    }
    assert!(
        !served.contains("a"),
        "a peer gone from DNS still got requests"
    );
    assert_eq!(served.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_srv_target_that_fails_once_keeps_its_peer_and_one_that_stays_gone_leaves() {
    use hickory_proto::rr::{rdata::SRV, Name, RData, RecordType};
    let (port, [a, b, backup]) = upstreams_on_one_port::<3>().await;
    // Targets whose address lookups fail right now.
    let failing = Arc::new(Mutex::new(Vec::<&'static str>::new()));
    let down = Arc::clone(&failing);
    let dns = fake_dns(Box::new(move |q| {
        let name = q.name().to_lowercase().to_ascii();
        match (q.query_type(), name.as_str()) {
            // t3 is of a higher priority number: a backup, used only when no other resolves.
            (RecordType::SRV, "gpu.test.") => [("t1.test.", 0), ("t2.test.", 0), ("t3.test.", 1)]
                .iter()
                .map(|(t, p)| RData::SRV(SRV::new(*p, 1, port, Name::from_ascii(t).unwrap())))
                .collect(),
            (RecordType::A, t @ ("t1.test." | "t2.test." | "t3.test."))
                if !down.lock().unwrap().contains(&t) =>
            {
                let last = t.as_bytes()[1] - b'0';
                vec![RData::A(hickory_proto::rr::rdata::A(Ipv4Addr::new(
                    127, 0, 0, last,
                )))]
            }
            _ => Vec::new(),
        }
    }))
    .await;
    let cfg = TestConfig::new()
        .dns("gpu.test.", dns.addr)
        .dns_srv()
        .dns_interval_ms(100)
        .dns_failures_before_removal(3)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let both = vec![a.addr_str(), b.addr_str()];
    until(&proxy, Duration::from_secs(5), |l| listed(l) == both).await;
    // One failed round (well under three intervals): the peer never leaves.
    failing.lock().unwrap().push("t2.test.");
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(150) {
        assert_eq!(
            listed(&proxy.peers().await),
            both,
            "one failed lookup moved keys"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    failing.lock().unwrap().clear();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(listed(&proxy.peers().await), both);
    // A target that stays gone leaves after three failed rounds.
    failing.lock().unwrap().push("t2.test.");
    until(&proxy, Duration::from_secs(5), |l| {
        listed(l) == vec![a.addr_str()]
    })
    .await;
    assert!(
        proxy.log().contains("keeping its last addresses"),
        "{}",
        proxy.log()
    );
    // With every target of the first priority gone, the backup serves.
    failing.lock().unwrap().push("t1.test.");
    until(&proxy, Duration::from_secs(5), |l| {
        listed(l) == vec![backup.addr_str()]
    })
    .await;
}
