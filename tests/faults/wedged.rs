//! A wedged engine, one that takes requests and sends nothing: found wedged, given no new
//! request while it is, and taken back once it moves again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::common::*;
use crate::{engine, engine_with_metrics, peer_entry, read_stream, stream, Answer};

fn streams(events: usize, first: Duration, gap: Duration) -> Answer {
    Arc::new(move |conn| tokio::spawn(stream(conn, events, first, gap)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_engine_gets_no_new_request_until_it_moves_again() {
    let wedged = Arc::new(AtomicBool::new(true));
    let release = Arc::new(Notify::new());
    let answer: Answer = {
        let (wedged, release) = (Arc::clone(&wedged), Arc::clone(&release));
        Arc::new(move |conn| {
            let (wedged, release) = (wedged.load(Ordering::SeqCst), Arc::clone(&release));
            tokio::spawn(async move {
                if wedged {
                    // Takes the request, says nothing until told to.
                    release.notified().await;
                }
                stream(conn, 2, Duration::ZERO, Duration::ZERO).await;
            })
        })
    };
    let stuck = engine(answer).await;
    let fine = engine(streams(2, Duration::ZERO, Duration::ZERO)).await;
    // Round robin alternates: without the wedge, every other request would go to the stuck one.
    let cfg = TestConfig::new()
        .peers_at([stuck.addr, fine.addr])
        .policy("round_robin")
        .wedge_after_ms(400);
    let proxy = start_proxy(&cfg).await;

    // Requests until one is stuck on the engine; it carries work and sends nothing from here.
    let mut hung = Vec::new();
    while stuck.posts.load(Ordering::SeqCst) == 0 {
        let url = proxy.url("/v1/chat/completions");
        hung.push(tokio::spawn(async move {
            client()
                .post(url)
                .body(chat("s", "q", 1, true))
                .send()
                .await
        }));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let wedged_at = Instant::now();
    loop {
        let entry = peer_entry(&proxy.peers().await, stuck.addr);
        if entry["wedged"] == true {
            break;
        }
        assert!(
            wedged_at.elapsed() < Duration::from_secs(3),
            "not found wedged: {entry}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let found = wedged_at.elapsed();
    assert!(
        found >= Duration::from_millis(300),
        "wedged too soon: {found:?}"
    );
    assert_eq!(
        sample(
            &proxy.metrics().await,
            &format!("prefixlb_peer_wedged{{peer=\"{}\"}}", stuck.addr)
        ),
        1.0
    );

    let before = stuck.posts.load(Ordering::SeqCst);
    for i in 0..8 {
        let (body, end) = read_stream(&proxy, &format!("while wedged {i}")).await;
        assert!(end.is_ok() && body.contains("[DONE]"), "{body} {end:?}");
    }
    assert_eq!(
        stuck.posts.load(Ordering::SeqCst),
        before,
        "a wedged engine got new requests"
    );
    assert!(proxy.log().contains("is wedged"), "{}", proxy.log());

    // It moves again: its stuck answers come; it is taken back.
    wedged.store(false, Ordering::SeqCst);
    release.notify_waiters();
    for h in hung {
        let r = h.await.unwrap().unwrap();
        assert_eq!(r.status(), 200);
        assert!(String::from_utf8_lossy(&r.bytes().await.unwrap()).contains("[DONE]"));
    }
    let entry = peer_entry(&proxy.peers().await, stuck.addr);
    assert_eq!(entry["wedged"], false, "{entry}");
    assert_eq!(entry["wedges"], 1, "{entry}");
    for i in 0..4 {
        let (body, end) = read_stream(&proxy, &format!("after {i}")).await;
        assert!(end.is_ok() && body.contains("[DONE]"), "{body} {end:?}");
    }
    assert!(
        stuck.posts.load(Ordering::SeqCst) > before,
        "the engine was not taken back"
    );
    proxy.assert_idle().await;
}

/// An answer that does not stream sends nothing until it is whole, which may take longer than
/// the wedge limit: an engine whose metrics show its work growing meanwhile is not wedged, and
/// one whose count of work stands still is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_answer_that_does_not_stream_wedges_no_engine_whose_work_grows() {
    // Each answer is held until the test has looked, then sent whole.
    let release = Arc::new(Notify::new());
    let whole = || -> Answer {
        let release = Arc::clone(&release);
        Arc::new(move |mut conn| {
            let release = Arc::clone(&release);
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                release.notified().await;
                let body = r#"{"choices":[{"message":{"content":"done"}}]}"#;
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(format!("{head}{body}").as_bytes()).await;
            })
        })
    };
    // vLLM's names; the work done grows at each read of the page, or stands still.
    let page = |grows: bool| {
        let done = Arc::new(AtomicU64::new(0));
        Arc::new(move || {
            let n = if grows {
                done.fetch_add(16, Ordering::SeqCst)
            } else {
                0
            };
            format!(
                "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total {n}\n"
            )
        }) as crate::Page
    };
    let working = engine_with_metrics(whole(), page(true)).await;
    let stuck = engine_with_metrics(whole(), page(false)).await;
    let cfg = TestConfig::new()
        .peers_at([working.addr, stuck.addr])
        .policy("round_robin")
        .wedge_after_ms(400)
        .engine_metrics(true)
        .engine_metrics_interval_ms(100);
    let proxy = start_proxy(&cfg).await;
    let asks: Vec<_> = (0..2)
        .map(|i| {
            let url = proxy.url("/v1/chat/completions");
            tokio::spawn(async move {
                client()
                    .post(url)
                    .body(chat("s", &format!("q{i}"), 1, false))
                    .send()
                    .await
            })
        })
        .collect();
    // Both answers under way for three times the limit.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let listing = proxy.peers().await;
    assert_eq!(
        (
            working.posts.load(Ordering::SeqCst),
            stuck.posts.load(Ordering::SeqCst)
        ),
        (1, 1)
    );
    assert_eq!(peer_entry(&listing, working.addr)["wedged"], false);
    assert_eq!(peer_entry(&listing, stuck.addr)["wedged"], true);
    release.notify_waiters();
    for ask in asks {
        assert_eq!(ask.await.unwrap().unwrap().status(), 200);
    }
    let working = peer_entry(&proxy.peers().await, working.addr);
    assert_eq!(working["wedges"], 0, "{working}");
    proxy.assert_idle().await;
}
