//! Streams: SSE events pass through as emitted, and a slot is released however a stream ends
//! (a client walking away, an upstream reset or timeout, a client that stops reading).

use std::time::{Duration, Instant};

use futures_util::StreamExt;

use crate::common::*;
use crate::CHAT;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_events_pass_through_as_they_are_emitted() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let r = client()
        .post(proxy.url(CHAT))
        .header("x-mock-events", "12")
        .header("x-mock-interval-ms", "50")
        // A client that takes compressed answers still gets the tokens as they come: a
        // compressor would hold them back to fill its blocks.
        .header("accept-encoding", "gzip, br, zstd")
        .body(chat("s", "stream me", 1, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert!(r.headers().get("content-encoding").is_none());
    let mut stream = r.bytes_stream();
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        let events = String::from_utf8_lossy(&chunk).matches("data: ").count();
        text.push_str(&String::from_utf8_lossy(&chunk));
        for _ in 0..events {
            arrivals.push(Instant::now());
        }
    }
    assert_eq!(text.matches("data: ").count(), 13, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    let mut gaps: Vec<u128> = arrivals
        .windows(2)
        .map(|w| (w[1] - w[0]).as_millis())
        .collect();
    gaps.sort_unstable();
    // Batching would show as gaps near 0 next to gaps of several intervals.
    assert!(gaps[0] >= 20, "events arrived batched: {gaps:?}");
    let median = gaps[gaps.len() / 2];
    assert!(
        (35..=80).contains(&median),
        "median gap {median} ms: {gaps:?}"
    );
    assert!(
        *gaps.last().unwrap() < 200,
        "an event was held back: {gaps:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_slot_is_released_when_clients_walk_away_mid_stream() {
    let ups = upstreams::<3>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..300u64 {
        let (c, url) = (c.clone(), proxy.url(CHAT));
        tasks.push(tokio::spawn(async move {
            let r = c
                .post(url)
                .header("x-mock-events", "20")
                .header("x-mock-interval-ms", "15")
                .body(chat("s", &format!("conversation {}", i % 40), 1, true))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            // Two in three clients hang up after a pseudo-random number of events.
            let keep = (i * 7919 % 20) as usize;
            let mut stream = r.bytes_stream();
            let mut got = 0;
            while let Some(chunk) = stream.next().await {
                got += String::from_utf8_lossy(&chunk.unwrap())
                    .matches("data: ")
                    .count();
                if i % 3 != 0 && got > keep {
                    return false;
                }
            }
            true
        }));
    }
    let mut completed = 0;
    for t in tasks {
        completed += usize::from(t.await.unwrap());
    }
    assert!(completed >= 100);
    let peers = proxy.wait_idle(Duration::from_secs(10)).await;
    for p in peers["peers"].as_array().unwrap() {
        assert_eq!(p["in_flight"], 0, "{peers}");
    }
    // The proxy closed the upstream side too: the mock servers stop streaming.
    let start = Instant::now();
    while ups
        .iter()
        .any(|u| u.active.load(std::sync::atomic::Ordering::SeqCst) > 0)
    {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "upstream streams kept running"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_are_released_on_upstream_resets_and_timeouts() {
    let ups = upstreams::<2>().await;
    let cfg = TestConfig::new().peers(&ups).read_timeout_ms(300);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..60u64 {
        let (c, url) = (c.clone(), proxy.url(CHAT));
        tasks.push(tokio::spawn(async move {
            let req = c.post(url).body(chat("s", &format!("c{i}"), 1, true));
            let req = match i % 3 {
                // The upstream drops the connection mid-stream.
                0 => req
                    .header("x-mock-events", "10")
                    .header("x-mock-reset-after", (i % 5 + 1).to_string()),
                // The upstream goes silent mid-stream, past the read timeout.
                1 => req
                    .header("x-mock-events", "3")
                    .header("x-mock-interval-ms", "1000"),
                // The upstream never answers the headers in time.
                _ => req.header("x-mock-delay-ms", "1000"),
            };
            let r = req
                .send()
                .await
                .unwrap_or_else(|e| panic!("request {i} was lost: {e:?}"));
            let status = r.status().as_u16();
            let (text, end) = read_body(r).await;
            (status, end.is_ok(), text)
        }));
    }
    let mut header_timeouts = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, whole, text) = t.await.unwrap();
        if i % 3 == 2 {
            assert_eq!(status, 504, "a silent upstream is a gateway timeout");
            header_timeouts += 1;
        } else if status == 200 {
            // A stream cut after its head ends with the event that says so, then the cut.
            let said = text
                .trim_end()
                .rsplit("\n\n")
                .next()
                .is_some_and(|e| e.starts_with("data: {\"error\"") && !text.contains("[DONE]"));
            assert!(
                said && !whole,
                "request {i}: a cut stream looked whole: {text}"
            );
        }
    }
    assert_eq!(header_timeouts, 20);
    let peers = proxy.wait_idle(Duration::from_secs(10)).await;
    assert_eq!(peers["in_flight"], 0, "{peers}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_gives_its_slot_back() {
    use tokio::io::AsyncWriteExt;
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(4)
        .queue_timeout_ms(10000)
        .client_write_timeout_ms(500)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    // A client with a small receive buffer that asks for a 32 MB stream and reads none of it.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(proxy.addr).await.unwrap();
    let body = chat("s", "q", 1, true);
    let request = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-mock-events: 4000\r\nx-mock-interval-ms: 0\r\nx-mock-event-bytes: 8192\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stalled.write_all(request.as_bytes()).await.unwrap();
    let start = Instant::now();
    while proxy.in_flight_of(&up.addr_str()).await == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the stream never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The only slot is taken; the next request has it once the stalled stream is cut.
    let r = client()
        .post(proxy.url(CHAT))
        .header("x-session-id", "someone else")
        .body(chat("s", "another", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "waited {:?} for the slot",
        start.elapsed()
    );
    proxy.assert_idle().await;
    let log = proxy
        .access_log_when(|l| l.contains("TimedOut") || l.contains("timeout"))
        .await;
    assert!(
        log.lines()
            .any(|l| l.contains("TimedOut") || l.contains("timeout")),
        "the access log does not say why the stream ended: {log}"
    );
    drop(stalled);
}
