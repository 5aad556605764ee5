//! Answers that break: a stream that stalls half-way, a long prefill then a byte at a time
//! (neither cut nor wedged), an engine killed mid-stream, and an engine that answers what is
//! not HTTP.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;

use crate::common::*;
use crate::{chunk, engine, event, peer_entry, read_stream, stream, Answer, SSE_HEAD};

/// The `error` object of the stream's last event, if it is an error event.
fn error_event(body: &str) -> Option<serde_json::Value> {
    let last = body.trim_end().rsplit("\n\n").next()?;
    let v: serde_json::Value = serde_json::from_str(last.strip_prefix("data: ")?).ok()?;
    v.get("error").cloned()
}

/// An engine that answers every request with a stream of `sent`, then falls silent with the
/// connection open for longer than a test, behind a proxy that ends a stream after 300 ms of
/// silence (and never takes the engine for wedged).
async fn stalling_after(sent: String) -> (crate::Engine, Proxy) {
    let stalling: Answer = Arc::new(move |mut conn| {
        let sent = sent.clone();
        tokio::spawn(async move {
            let _ = conn.write_all(SSE_HEAD.as_bytes()).await;
            let _ = conn.write_all(&chunk(&sent)).await;
            tokio::time::sleep(Duration::from_secs(60)).await;
            drop(conn);
        })
    });
    let engine = engine(stalling).await;
    let cfg = TestConfig::new()
        .peers_at([engine.addr])
        .stream_idle_timeout_ms(300)
        .wedge_after_ms(0);
    let proxy = start_proxy(&cfg).await;
    (engine, proxy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stalls_half_way_ends_with_an_error_event_and_frees_its_slot() {
    let events: String = (0..2).map(|i| event(&format!("t{i}"))).collect();
    let (_engine, proxy) = stalling_after(events).await;
    let started = Instant::now();
    let (body, end) = read_stream(&proxy, "stalls").await;
    let took = started.elapsed();
    assert!(end.is_err(), "the stream looked whole: {body}");
    assert!(body.contains("t0") && body.contains("t1"), "{body}");
    let error = error_event(&body).unwrap_or_else(|| panic!("no error event: {body}"));
    assert_eq!(error["code"], "upstream_stalled", "{error}");
    assert!(
        took >= Duration::from_millis(280) && took < Duration::from_secs(5),
        "{took:?}"
    );
    proxy.assert_idle().await;
    let metrics = proxy.metrics().await;
    assert_eq!(
        sample(&metrics, "prefixlb_stream_errors_total{reason=\"stalled\"}"),
        1.0
    );
}

/// A Messages API stream ends in Anthropic's own shape, a named `error` event, which its SDKs
/// read (they pass over events without a name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_stream_that_stalls_ends_with_a_named_error_event() {
    let start = "event: message_start\ndata: {\"type\":\"message_start\"}\n\n";
    let (_engine, proxy) = stalling_after(start.to_owned()).await;
    let body =
        r#"{"model":"m","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"q"}]}"#;
    let r = client()
        .post(proxy.url("/v1/messages"))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (body, end) = read_body(r).await;
    assert!(end.is_err(), "the stream looked whole: {body}");
    let last = body.trim_end().rsplit("\n\n").next().unwrap();
    let data = last
        .strip_prefix("event: error\ndata: ")
        .unwrap_or_else(|| panic!("no named error event: {body}"));
    let v: serde_json::Value = serde_json::from_str(data).unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "api_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("sent nothing"),
        "{v}"
    );
    proxy.assert_idle().await;
}

/// The limit starts at the first byte of the answer: a prefill longer than it is not cut,
/// nor is a stream whose bytes come slower than the limit would allow in all but never that
/// far apart (a byte every third of the limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prefill_and_a_byte_at_a_time_are_neither_cut_nor_wedged() {
    let dribble: Answer = Arc::new(|mut conn| {
        tokio::spawn(async move {
            let _ = conn.write_all(SSE_HEAD.as_bytes()).await;
            // The prefill: twice the stream limit (less than the wedge limit) before a byte.
            tokio::time::sleep(Duration::from_millis(600)).await;
            let text = format!("{}{}data: [DONE]\n\n", event("a"), event("b"));
            for b in text.bytes() {
                let _ = conn.write_all(&chunk(&(b as char).to_string())).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = conn.write_all(b"0\r\n\r\n").await;
        })
    });
    let engine = engine(dribble).await;
    let cfg = TestConfig::new()
        .peers_at([engine.addr])
        .stream_idle_timeout_ms(300)
        .wedge_after_ms(1_000);
    let proxy = start_proxy(&cfg).await;
    let (body, end) = read_stream(&proxy, "slow").await;
    assert!(end.is_ok(), "{end:?}: {body}");
    assert_eq!(
        body,
        format!("{}{}data: [DONE]\n\n", event("a"), event("b"))
    );
    let entry = peer_entry(&proxy.peers().await, engine.addr);
    assert_eq!(entry["wedges"], 0, "{entry}");
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_mid_stream_ends_the_stream_with_an_error_and_the_next_turn_goes_on() {
    // Whichever engine takes the first turn dies in the middle of it: its connection reset,
    // its listener gone, as with a killed process.
    let killed = Arc::new(AtomicBool::new(false));
    let mut engines = Vec::new();
    for _ in 0..2 {
        let killed = Arc::clone(&killed);
        let answer: Answer = Arc::new(move |mut conn| {
            let dies = !killed.swap(true, Ordering::SeqCst);
            tokio::spawn(async move {
                if !dies {
                    return stream(conn, 2, Duration::ZERO, Duration::ZERO).await;
                }
                let _ = conn.write_all(SSE_HEAD.as_bytes()).await;
                let _ = conn.write_all(&chunk(&event("t0"))).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
                let _ = socket2::SockRef::from(&conn).set_linger(Some(Duration::ZERO));
                drop(conn);
            })
        });
        engines.push(engine(answer).await);
    }
    let cfg = TestConfig::new().peers_at(engines.iter().map(|e| e.addr));
    let proxy = start_proxy(&cfg).await;
    let (body, end) = read_stream(&proxy, "conversation").await;
    let dead = engines
        .iter()
        .position(|e| e.posts.load(Ordering::SeqCst) == 1)
        .unwrap();
    // The killed engine's listener goes too: its next connect is refused.
    engines.remove(dead);
    assert!(end.is_err(), "the stream looked whole: {body}");
    assert!(body.contains("t0"), "{body}");
    let error = error_event(&body).unwrap_or_else(|| panic!("no error event: {body}"));
    assert_eq!(error["code"], "upstream_error", "{error}");
    assert_eq!(error["type"], "server_error", "{error}");
    proxy.assert_idle().await;

    let (body, end) = read_stream(&proxy, "conversation").await;
    assert!(end.is_ok() && body.contains("[DONE]"), "{end:?}: {body}");
    assert_eq!(
        engines[0].posts.load(Ordering::SeqCst),
        1,
        "the next turn went elsewhere"
    );
    assert_eq!(
        sample(
            &proxy.metrics().await,
            "prefixlb_stream_errors_total{reason=\"broken\"}"
        ),
        1.0
    );
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_answers_what_is_not_http_gets_its_client_a_clear_error() {
    // Not a status line: nothing has reached the client, so it gets a whole 502.
    let garbage: Answer = Arc::new(|mut conn| {
        tokio::spawn(async move {
            let _ = conn.write_all(b"HELLO THERE\r\n\r\n").await;
        })
    });
    // A stream whose chunk framing breaks after one event: the client has its head already.
    let bad_chunk: Answer = Arc::new(|mut conn| {
        tokio::spawn(async move {
            let _ = conn.write_all(SSE_HEAD.as_bytes()).await;
            let _ = conn.write_all(&chunk(&event("t0"))).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = conn.write_all(b"zz\r\nnot a chunk\r\n").await;
            tokio::time::sleep(Duration::from_secs(5)).await;
        })
    });
    for (answer, streamed) in [(garbage, false), (bad_chunk, true)] {
        let engine = engine(answer).await;
        let cfg = TestConfig::new().peers_at([engine.addr]).connect_retries(0);
        let proxy = start_proxy(&cfg).await;
        let r = client()
            .post(proxy.url("/v1/chat/completions"))
            .body(chat("s", "q", 1, true))
            .send()
            .await
            .unwrap();
        if streamed {
            assert_eq!(r.status(), 200);
            let (body, end) = read_body(r).await;
            assert!(end.is_err(), "the stream looked whole: {body}");
            assert!(body.contains("t0"), "{body}");
            let error = error_event(&body).unwrap_or_else(|| panic!("no error event: {body}"));
            assert_eq!(error["code"], "upstream_error", "{error}");
        } else {
            assert_eq!(r.status(), 502);
            let v: serde_json::Value = r.json().await.unwrap();
            assert_eq!(v["error"]["code"], "upstream_error", "{v}");
        }
        proxy.assert_idle().await;
    }
}

/// On HTTP/1.1 a cut stream stays cut on the wire: the error event, then the close, with no
/// end to the chunked body. A body that looked whole would let a keep-alive client pool the
/// connection the proxy then closes, and lose its next request to that close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_stream_does_not_look_whole_to_a_keep_alive_client() {
    use tokio::io::AsyncReadExt;
    let cut: Answer = Arc::new(|mut conn| {
        tokio::spawn(async move {
            let _ = conn.write_all(SSE_HEAD.as_bytes()).await;
            let _ = conn.write_all(&chunk(&event("t0"))).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = socket2::SockRef::from(&conn).set_linger(Some(Duration::ZERO));
            drop(conn);
        })
    });
    let engine = engine(cut).await;
    let cfg = TestConfig::new().peers_at([engine.addr]).connect_retries(0);
    let proxy = start_proxy(&cfg).await;
    let body = chat("s", "q", 1, true);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: keep-alive\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut raw))
        .await
        .expect("the connection stayed open after the cut")
        .unwrap();
    let raw = String::from_utf8_lossy(&raw).to_lowercase();
    assert!(raw.starts_with("http/1.1 200"), "{raw}");
    assert!(raw.contains("transfer-encoding: chunked"), "{raw}");
    assert!(
        raw.contains("t0") && raw.contains("upstream_error"),
        "{raw}"
    );
    assert!(
        !raw.ends_with("0\r\n\r\n"),
        "the cut body ended whole: {raw}"
    );
    proxy.assert_idle().await;
}
