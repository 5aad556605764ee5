//! Peers that come and go: a peer whose DNS name flaps loses no request, and a retry off a dead
//! engine waits in line for a slot when the others are full.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::dns::*;
use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_whose_dns_name_flaps_loses_no_request() {
    use hickory_proto::rr::{rdata::A, Name, RData, RecordType};
    use std::net::Ipv4Addr;
    let (port, [a, b]) = upstreams_on_one_port::<2>().await;
    // Query by query: both addresses, the first alone, nothing at all; over and over.
    let queries = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&queries);
    let name = Name::from_ascii("gpu.test.").unwrap().to_lowercase();
    let dns = fake_dns(Box::new(move |q| {
        if q.query_type() != RecordType::A || q.name().to_lowercase() != name {
            return Vec::new();
        }
        let ips: &[[u8; 4]] = match counted.fetch_add(1, Ordering::SeqCst) % 3 {
            0 => &[[127, 0, 0, 1], [127, 0, 0, 2]],
            1 => &[[127, 0, 0, 1]],
            _ => &[],
        };
        ips.iter()
            .map(|ip| RData::A(A(Ipv4Addr::from(*ip))))
            .collect()
    }))
    .await;
    let cfg = TestConfig::new()
        .dns("gpu.test.", dns.addr)
        .dns_port(port)
        .dns_interval_ms(50)
        .dns_max_in_flight(16);
    let proxy = start_proxy(&cfg).await;
    // Streams of a second each and short requests, while the name flaps twenty times.
    let streams: Vec<_> = (0..6)
        .map(|i| {
            let url = proxy.url("/v1/chat/completions");
            tokio::spawn(async move {
                let r = client()
                    .post(url)
                    .header("x-mock-events", "10")
                    .header("x-mock-interval-ms", "100")
                    .body(chat(&format!("stream {i}"), "q", 1, true))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
                r.bytes().await.unwrap()
            })
        })
        .collect();
    let mut served = 0;
    for i in 0..40 {
        let r = client()
            .post(proxy.url("/v1/chat/completions"))
            .body(chat(&format!("short {i}"), "q", 1, false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", proxy.log());
        r.bytes().await.unwrap();
        served += 1;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    for s in streams {
        let body = String::from_utf8_lossy(&s.await.unwrap()).into_owned();
        assert!(
            body.ends_with("data: [DONE]\n\n"),
            "a stream was cut: {body}"
        );
    }
    assert_eq!(served, 40);
    assert!(
        queries.load(Ordering::SeqCst) >= 12,
        "the name did not flap"
    );
    assert!(!a.seen().is_empty() && !b.seen().is_empty());
    proxy.assert_idle().await;
}

/// A request whose engine is gone (killed, its port refusing) while every other engine is at
/// its bound waits in line for a slot instead of being answered 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_off_a_dead_engine_waits_in_line_when_the_others_are_full() {
    let live = start_upstream("live").await;
    let (dead, _held) = refused_addr();
    let cfg = TestConfig::new()
        .peers_at([live.addr, dead])
        .max_in_flight(1)
        .policy("round_robin")
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    // The live engine's one slot, held for half a second.
    let holder = open_stream(&proxy, 5, 100).await;
    let reader = tokio::spawn(async move { holder.bytes().await.unwrap() });
    // Round robin sends the next to the dead engine: refused, retried, in line until the slot
    // is free.
    let started = Instant::now();
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .body(chat("s", "next", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", proxy.log());
    assert_eq!(r.headers()["x-upstream"], "live");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "it did not wait"
    );
    reader.await.unwrap();
    assert_eq!(
        sample(
            &proxy.metrics().await,
            "prefixlb_rejections_total{reason=\"queue_timeout\"}"
        ),
        0.0
    );
    proxy.assert_idle().await;
}
