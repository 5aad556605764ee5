//! The real proxy binary against mock inference servers on loopback.

mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;

const CHAT: &str = "/v1/chat/completions";

async fn post_chat(c: &reqwest::Client, proxy: &Proxy, body: String) -> reqwest::Response {
    c.post(proxy.url(CHAT))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap()
}

fn upstream_of(r: &reqwest::Response) -> String {
    r.headers()["x-upstream"].to_str().unwrap().to_owned()
}

/// Every conversation keeps its upstream across turns. Conversations with prompts of their own
/// spread by their keys; those that open on a system prompt one upstream holds go there while it
/// is idle, since a prefill of the shared part is saved there and nothing is paid for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_stick_to_one_upstream_across_turns() {
    let ups = upstreams::<3>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let shared = "You are the triage assistant of St. Mary's. ".repeat(30);
    let (mut own_homes, mut shared_homes) = (HashSet::new(), HashSet::new());
    for conv in 0..24 {
        let own = format!("You are the assistant of ward {conv}. ").repeat(30);
        let system = if conv % 2 == 0 { &own } else { &shared };
        let mut seen = HashSet::new();
        for turn in 1..=5 {
            let r = post_chat(
                &c,
                &proxy,
                chat(system, &format!("patient {conv}"), turn, false),
            )
            .await;
            assert_eq!(r.status(), 200);
            seen.insert(upstream_of(&r));
        }
        assert_eq!(seen.len(), 1, "conversation {conv} moved: {seen:?}");
        if conv % 2 == 0 {
            own_homes.extend(seen);
        } else {
            shared_homes.extend(seen);
        }
    }
    assert!(
        own_homes.len() >= 2,
        "12 conversations all landed on {own_homes:?}"
    );
    assert_eq!(shared_homes.len(), 1, "{shared_homes:?}");
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_primary_overflows_to_the_next_ring_peer_and_the_key_comes_back() {
    let ups = upstreams::<3>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .max_in_flight(1)
        .balance_factor(None);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let body = chat("sys", "the hot conversation", 1, true);
    let home = upstream_of(&post_chat(&c, &proxy, body.clone()).await);

    // Hold the primary's only slot with a long stream.
    let long = c
        .post(proxy.url(CHAT))
        .header("x-mock-events", "10")
        .header("x-mock-interval-ms", "100")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(upstream_of(&long), home);
    let during = post_chat(&c, &proxy, body.clone()).await;
    assert_eq!(during.status(), 200);
    assert_ne!(
        upstream_of(&during),
        home,
        "the full primary was not skipped"
    );
    let _ = long.bytes().await.unwrap();

    proxy.wait_idle(Duration::from_secs(5)).await;
    let after = post_chat(&c, &proxy, body).await;
    assert_eq!(upstream_of(&after), home, "the key did not come home");
}

async fn post_prompt(
    c: &reqwest::Client,
    proxy: &Proxy,
    prompt: &str,
    stream_ms: Option<u32>,
) -> reqwest::Response {
    let body = serde_json::json!({"model": "m", "stream": true, "prompt": prompt}).to_string();
    let mut req = c.post(proxy.url("/v1/completions")).body(body);
    if let Some(ms) = stream_ms {
        req = req
            .header("x-mock-events", "20")
            .header("x-mock-interval-ms", (ms / 20).to_string());
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200);
    r
}

/// Turn `n` of doctor `who`'s conversation, sent as one growing completions prompt after the
/// ward's shared template (8 KiB: its first 2048 characters are every conversation's key).
fn ward_turn(who: &str, n: usize) -> String {
    let mut p = "Protocol of the ward: check, chart, report. ".repeat(200);
    for t in 1..=n {
        p.push_str(&format!(
            "Doctor {who}, turn {t}: {}\nAssistant: ",
            "symptom ".repeat(500)
        ));
        if t < n {
            p.push_str("noted.\n");
        }
    }
    p
}

/// Conversations sent as one growing completions prompt share one key (the template's first
/// 2048 characters): the record of where their blocks went is what tells them apart. A turn
/// goes where its own history is, not where the template went last, and the record counts
/// its blocks in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_follows_its_own_history_inside_a_shared_prompt() {
    let ups = upstreams::<3>().await;
    let cfg = TestConfig::new()
        .peers(&ups)
        .max_in_flight(1)
        .prefix_record_mib(2);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let home = upstream_of(&post_prompt(&c, &proxy, &ward_turn("a", 1), None).await);
    // B's first turn finds the template's peer full and goes elsewhere.
    let held = post_prompt(&c, &proxy, &ward_turn("a", 1), Some(2_000)).await;
    assert_eq!(upstream_of(&held), home);
    let b = upstream_of(&post_prompt(&c, &proxy, &ward_turn("b", 1), None).await);
    assert_ne!(b, home, "the full peer was not skipped");
    let _ = held.bytes().await.unwrap();
    proxy.wait_idle(Duration::from_secs(5)).await;
    // C's first turn goes home, which served the template last.
    let c1 = upstream_of(&post_prompt(&c, &proxy, &ward_turn("c", 1), None).await);
    assert_eq!(c1, home);
    // B's second turn goes to B's history, not to where the template went last.
    let b2 = upstream_of(&post_prompt(&c, &proxy, &ward_turn("b", 2), None).await);
    assert_eq!(b2, b, "B's turn 2 lost its history");
    let m = proxy.metrics().await;
    let gauge = |name: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    let budget = (2 << 20) as f64;
    let bytes = gauge("prefixlb_prefix_record_bytes");
    assert!(bytes <= budget && bytes > budget * 0.99, "{bytes}");
    // Template and turns: at least the template's 8 blocks and each turn's own.
    assert!(gauge("prefixlb_prefix_record_entries") >= 10.0);
    assert_eq!(gauge("prefixlb_prefix_record_evictions_total"), 0.0);
    // Raw prompts show nothing of other processes: none is a chat's later turn.
    let unseen = gauge("prefixlb_prefix_record_unseen_later_turns_ratio");
    assert_eq!(unseen, 1.0, "taken as alone without a chat's later turn");
    proxy.assert_idle().await;
}

/// Replicas that tell each other where prompts went: a conversation one of them moved off its
/// full peer is followed there by another, which never saw it; a process not told sends the
/// next turn where the shared prompt's key goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_sends_a_turn_where_another_replica_sent_its_conversation() {
    let ups = upstreams::<3>().await;
    let base = TestConfig::new()
        .peers(&ups)
        .max_in_flight(1)
        .prefix_record_mib(2);
    let told = replicas(2);
    let a = start_proxy(&base.clone().replica(&told[0])).await;
    let b = start_proxy(&base.clone().replica(&told[1])).await;
    let apart = start_proxy(&base).await;
    let c = client();
    let held = post_prompt(&c, &a, &ward_turn("a", 1), Some(2_000)).await;
    let home = upstream_of(&held);
    let moved = upstream_of(&post_prompt(&c, &a, &ward_turn("b", 1), None).await);
    assert_ne!(moved, home, "the full peer was not skipped");
    let _ = held.bytes().await.unwrap();
    a.wait_idle(Duration::from_secs(5)).await;

    let heard = |m: String| sample(&m, r#"prefixlb_replica_messages_total{event="heard"}"#);
    let start = Instant::now();
    while heard(b.metrics().await) < 2.0 {
        assert!(start.elapsed() < Duration::from_secs(5), "b heard nothing");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let via_b = upstream_of(&post_prompt(&c, &b, &ward_turn("b", 2), None).await);
    assert_eq!(via_b, moved, "b did not follow the conversation a moved");
    let via_apart = upstream_of(&post_prompt(&c, &apart, &ward_turn("b", 2), None).await);
    assert_eq!(
        via_apart, home,
        "a process not told sends it where its key goes"
    );

    // What an address that is no replica's sends is refused.
    use prefixlb::control::replicas::{encode_entry, MAGIC};
    let b_listen = told[1].listen;
    let mut stray = MAGIC.to_vec();
    assert!(encode_entry(&mut stray, &ups[0].addr_str(), &[1, 2, 3]));
    let from = std::net::UdpSocket::bind("127.0.0.2:0").unwrap();
    from.send_to(&stray, b_listen).unwrap();
    let refused =
        |m: String| sample(&m, r#"prefixlb_replica_messages_total{event="refused"}"#) == 1.0;
    let start = Instant::now();
    while !refused(b.metrics().await) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the stray datagram was not refused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        heard(b.metrics().await),
        2.0,
        "b recorded the stray datagram"
    );
    for p in [&a, &b, &apart] {
        p.assert_idle().await;
    }
}

/// A chat body of exactly `len` bytes whose key needs all of it: the first user message is the
/// filler and `model` comes last, so the peek reads as far as it may.
fn sized_body(len: usize) -> Vec<u8> {
    if len == 0 {
        return Vec::new();
    }
    let head = br#"{"messages":[{"role":"user","content":""#;
    let tail = br#""}],"model":"m"}"#;
    let filler = len.saturating_sub(head.len() + tail.len());
    let mut body = Vec::with_capacity(len);
    body.extend_from_slice(head);
    body.extend((0..filler).map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789 "[i % 37]));
    body.extend_from_slice(tail);
    body.truncate(len);
    body
}

enum Framing {
    Length,
    Chunked(usize),
    Trickle { pieces: usize, gap_ms: u64 },
}

fn framed(body: Vec<u8>, framing: &Framing) -> reqwest::Body {
    match *framing {
        Framing::Length => reqwest::Body::from(body),
        Framing::Chunked(size) => {
            let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
                body.chunks(size).map(|c| Ok(c.to_vec())).collect();
            reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
        }
        Framing::Trickle { pieces, gap_ms } => {
            let size = body.len().div_ceil(pieces).max(1);
            let chunks: Vec<Vec<u8>> = body.chunks(size).map(<[u8]>::to_vec).collect();
            let stream = futures_util::stream::iter(chunks).then(move |c| async move {
                tokio::time::sleep(Duration::from_millis(gap_ms)).await;
                Ok::<_, std::io::Error>(c)
            });
            reqwest::Body::wrap_stream(stream)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_reach_the_upstream_byte_for_byte() {
    let ups = upstreams::<2>().await;
    // A peek limit past Pingora's 64 KiB replay buffer exercises the re-injection path.
    let cfg = TestConfig::new().peers(&ups).peek_limit_bytes(1048576);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    const K: usize = 1024;
    let mut cases: Vec<(usize, Framing)> = Vec::new();
    for len in [0, K, 63 * K, 65 * K, 1024 * K, 20 * 1024 * K] {
        cases.push((len, Framing::Length));
        cases.push((len, Framing::Chunked(if len <= 65 * K { 1 } else { 4093 })));
    }
    cases.push((
        66 * K,
        Framing::Trickle {
            pieces: 40,
            gap_ms: 10,
        },
    ));
    cases.push((
        2 * K,
        Framing::Trickle {
            pieces: 20,
            gap_ms: 15,
        },
    ));
    for (len, framing) in cases {
        let label = match framing {
            Framing::Length => format!("{len} B content-length"),
            Framing::Chunked(s) => format!("{len} B chunked by {s}"),
            Framing::Trickle { .. } => format!("{len} B trickled"),
        };
        let body = sized_body(len);
        let want = sha256_hex(&body);
        for path in [CHAT, "/v1/embeddings"] {
            let r = c
                .post(proxy.url(path))
                .body(framed(body.clone(), &framing))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{label} to {path}: {}", proxy.log());
            let echo: serde_json::Value = r.json().await.unwrap();
            assert_eq!(echo["len"], len, "{label} to {path}: length");
            assert_eq!(
                echo["sha256"],
                want.as_str(),
                "{label} to {path}: bytes differ"
            );
        }
    }
    proxy.assert_idle().await;
}

/// A chat turn with `model` last (as openai-python sends it) and `exchanges` earlier turns of
/// about 1.5 KiB each.
fn model_last_turn(conversation: &str, exchanges: usize) -> String {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a careful assistant."}),
        serde_json::json!({"role": "user", "content": conversation}),
    ];
    for t in 0..exchanges {
        messages.push(
            serde_json::json!({"role": "assistant", "content": format!("answer {t} ").repeat(150)}),
        );
        messages.push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
    }
    format!(
        r#"{{"messages":{},"stream":false,"model":"m"}}"#,
        serde_json::Value::from(messages)
    )
}

/// Posts a chat body; asserts that the upstream got exactly these bytes; returns which one.
async fn echoed(c: &reqwest::Client, proxy: &Proxy, body: Vec<u8>, framing: &Framing) -> String {
    let want = sha256_hex(&body);
    let r = c
        .post(proxy.url(CHAT))
        .body(framed(body, framing))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", proxy.log());
    let echo: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        echo["sha256"],
        want.as_str(),
        "the upstream got other bytes"
    );
    echo["upstream"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_turns_past_the_peek_limit_stay_with_their_conversation() {
    let ups = upstreams::<3>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let mut homes = HashSet::new();
    for conv in 0..9 {
        let name = format!("conversation {conv} opens");
        let first = model_last_turn(&name, 0);
        let long = model_last_turn(&name, 70);
        assert!(long.len() > 100 * 1024);
        let mut served = HashSet::new();
        for (body, framing) in [
            (first.clone(), Framing::Length),
            (long.clone(), Framing::Length),
            (long.clone(), Framing::Chunked(4093)),
            (long, Framing::Chunked(65536)),
        ] {
            served.insert(echoed(&c, &proxy, body.into_bytes(), &framing).await);
        }
        assert_eq!(
            served.len(),
            1,
            "conversation {conv} moved between turns: {served:?}"
        );
        homes.extend(served);
    }
    assert!(homes.len() >= 2, "all conversations on {homes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_ending_just_past_the_peek_window_keys_on_the_window() {
    // The first user message alone is longer than the 64 KiB window: the key is the window.
    let ups = upstreams::<3>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let body = |conversation: usize, tail: &str| {
        let content = format!("conversation {conversation}: {}{tail}", "x".repeat(69_000));
        serde_json::json!({"messages": [{"role": "user", "content": content}], "model": "m"})
            .to_string()
    };
    let mut homes = HashSet::new();
    for conversation in 0..8 {
        let mut served = HashSet::new();
        for tail in ["one ending", "another, longer ending"] {
            let b = body(conversation, tail).into_bytes();
            served.insert(echoed(&c, &proxy, b, &Framing::Length).await);
        }
        assert_eq!(
            served.len(),
            1,
            "bytes past the window moved conversation {conversation}"
        );
        homes.extend(served);
    }
    assert!(
        homes.len() >= 2,
        "every conversation fell back to one peer: {homes:?}"
    );
}

/// What a client that sends `Expect: 100-continue` sees: what the proxy answers before the body
/// is sent (the head of a 100, or of a final answer), then, once the body is sent, the rest up
/// to the close.
async fn continue_exchange(proxy: &Proxy, headers: &str, body: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n{headers}\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut first = Vec::new();
    let mut buf = [0u8; 4096];
    let interim = tokio::time::timeout(Duration::from_secs(3), async {
        while !String::from_utf8_lossy(&first).contains("\r\n\r\n") {
            let n = s.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before any answer");
            first.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    assert!(
        interim.is_ok(),
        "no answer while the proxy waits for the body"
    );
    // A proxy that has answered may have closed already: the body is then not wanted.
    let _ = s.write_all(body.as_bytes()).await;
    (
        String::from_utf8_lossy(&first).into_owned(),
        read_to_close(&mut s).await,
    )
}

/// What the proxy sends on `s` from now until it closes (or 5 s pass).
async fn read_to_close(s: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(n @ 1..) = s.read(&mut buf).await {
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await;
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expect_100_continue_is_answered_before_the_body_is_read() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let body = chat("s", "a client that waits for 100 Continue", 1, false);
    let (interim, rest) = continue_exchange(&proxy, "", &body).await;
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim}");
    assert!(rest.starts_with("HTTP/1.1 200"), "{rest}");
    assert!(rest.contains(&sha256_hex(body.as_bytes())), "{rest}");
}

/// Once the 100 is out, an error later on is still answered, and logged, as itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_failure_after_100_continue_is_answered_502() {
    let (dead, _refusing) = refused_addr();
    let cfg = TestConfig::new()
        .peers_at([dead])
        .connect_retries(0)
        .no_health_check()
        .access_log("json");
    let proxy = start_proxy(&cfg).await;
    let (interim, rest) = continue_exchange(&proxy, "", &chat("s", "q", 1, false)).await;
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim}");
    assert!(
        rest.starts_with("HTTP/1.1 502"),
        "a bare close after the 100: {rest:?}"
    );
    assert!(rest.contains("upstream_error"), "{rest}");
    proxy.assert_idle().await;
    let logged = proxy.access_log_when(|l| l.contains("\"status\"")).await;
    assert!(logged.contains("\"status\":502"), "{logged}");
    proxy.assert_idle().await;
}

/// A key the headers give is admitted before the client is told to send its body: a full
/// cluster answers 503 at once, and a free one lets the engine answer the 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_key_is_admitted_before_100_continue() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(0)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let body = chat("s", "a large upload", 1, false);
    let held = open_stream(&proxy, 30, 100).await;
    let (first, _) = continue_exchange(&proxy, "x-session-id: s1\r\n", &body).await;
    assert!(first.starts_with("HTTP/1.1 503"), "{first}");
    drop(held);
    proxy.assert_idle().await;
    let (interim, rest) = continue_exchange(&proxy, "x-session-id: s1\r\n", &body).await;
    assert!(interim.starts_with("HTTP/1.1 100"), "{interim}");
    assert!(rest.starts_with("HTTP/1.1 200"), "{rest}");
    assert!(rest.contains(&sha256_hex(body.as_bytes())), "{rest}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_events_pass_through_as_they_are_emitted() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let r = client()
        .post(proxy.url(CHAT))
        .header("x-mock-events", "12")
        .header("x-mock-interval-ms", "50")
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
            match req.send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    match r.bytes().await {
                        // A stream that ends cleanly must end with the error event that says
                        // it was cut.
                        Ok(body) => {
                            let body = String::from_utf8_lossy(&body).into_owned();
                            let said = body.trim_end().rsplit("\n\n").next().is_some_and(|e| {
                                e.starts_with("data: {\"error\"") && !body.contains("[DONE]")
                            });
                            (status, true, said)
                        }
                        Err(_) => (status, false, false),
                    }
                }
                Err(_) => (0, false, false),
            }
        }));
    }
    let mut header_timeouts = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, complete, said) = t.await.unwrap();
        if i % 3 == 2 {
            assert_eq!(status, 504, "a silent upstream is a gateway timeout");
            header_timeouts += 1;
        } else {
            assert!(
                !complete || status != 200 || said,
                "a cut stream looked complete"
            );
        }
    }
    assert_eq!(header_timeouts, 20);
    let peers = proxy.wait_idle(Duration::from_secs(10)).await;
    assert_eq!(peers["in_flight"], 0, "{peers}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturation_waits_in_line_then_answers_503() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .balance_factor(None)
        .max_waiting(1)
        .queue_timeout_ms(400);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let hold = |events: u32| {
        c.post(proxy.url(CHAT))
            .header("x-mock-events", events.to_string())
            .header("x-mock-interval-ms", "50")
            .body(chat("s", "holder", 1, true))
            .send()
    };

    // Sends a chat request in the background; yields its status, Retry-After, wait and body.
    let waiter = |conversation: &'static str| {
        let (c, url) = (c.clone(), proxy.url(CHAT));
        tokio::spawn(async move {
            let start = Instant::now();
            let r = c
                .post(url)
                .body(chat("s", conversation, 1, false))
                .send()
                .await
                .unwrap();
            let retry_after = r.headers().get("retry-after").cloned();
            (
                r.status(),
                retry_after,
                start.elapsed(),
                r.text().await.unwrap(),
            )
        })
    };

    // A short holder: the waiter gets the slot once it ends.
    let holder = hold(4).await.unwrap();
    let served = waiter("waiter");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _ = holder.bytes().await.unwrap();
    let (status, _, waited, _) = served.await.unwrap();
    assert_eq!(status, 200);
    assert!(
        waited >= Duration::from_millis(100),
        "served without waiting: {waited:?}"
    );

    // A long holder: one waiter times out, the one behind it finds the line full.
    let holder = hold(40).await.unwrap();
    let timed_out = waiter("w1");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (status, retry_after, _, body) = waiter("w2").await.unwrap();
    assert_eq!(status, 503);
    assert!(retry_after.is_some());
    let err: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["code"], "cluster_saturated");
    assert_eq!(err["error"]["type"], "server_error");
    assert!(err["error"]["message"].is_string());

    let (status, retry_after, waited, body) = timed_out.await.unwrap();
    assert_eq!(status, 503);
    assert_eq!(retry_after.unwrap(), "1");
    assert!(waited >= Duration::from_millis(380), "{waited:?}");
    let err: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["code"], "queue_timeout");
    drop(holder);
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_length_queue_rejects_at_once() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .balance_factor(None)
        .max_waiting(0);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let holder = c
        .post(proxy.url(CHAT))
        .header("x-mock-events", "20")
        .header("x-mock-interval-ms", "50")
        .body(chat("s", "holder", 1, true))
        .send()
        .await
        .unwrap();
    let start = Instant::now();
    let r = c
        .post(proxy.url(CHAT))
        .body(chat("s", "x", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(start.elapsed() < Duration::from_millis(300));
    drop(holder);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_peer_is_skipped_by_retrying_the_next_one() {
    let live = start_upstream("live").await;
    // An address nobody listens on: connects are refused.
    let (dead, _refusing) = refused_addr();
    let cfg = TestConfig::new()
        .peers_at([dead, live.addr])
        .connect_retries(1)
        .peek_limit_bytes(150000)
        .no_health_check()
        .consecutive_failures(0);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    for i in 0..40 {
        let r = post_chat(
            &c,
            &proxy,
            chat("s", &format!("conversation {i}"), 1, false),
        )
        .await;
        assert_eq!(r.status(), 200, "{}", proxy.log());
        assert_eq!(upstream_of(&r), "live");
    }
    assert_eq!(
        live.seen().len(),
        40,
        "every request reached the live peer exactly once"
    );
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_stop_at_the_configured_count() {
    let refusing: Vec<_> = (0..3).map(|_| refused_addr()).collect();
    let cfg = TestConfig::new()
        .peers_at(refusing.iter().map(|(a, _)| *a))
        .connect_retries(1);
    let proxy = start_proxy(&cfg).await;
    let r = post_chat(&client(), &proxy, chat("s", "q", 1, false)).await;
    assert_eq!(r.status(), 502);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["error"]["code"], "upstream_error");
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_413() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new().peers(&[&up]).max_body_bytes(100000);
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let big = sized_body(200_000);
    for (path, framing) in [
        (CHAT, Framing::Length),
        (CHAT, Framing::Chunked(8192)),
        ("/v1/embeddings", Framing::Length),
        ("/v1/embeddings", Framing::Chunked(8192)),
    ] {
        let r = c
            .post(proxy.url(path))
            .body(framed(big.clone(), &framing))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 413, "{path}");
        let err: serde_json::Value = r.json().await.unwrap();
        assert_eq!(err["error"]["type"], "invalid_request_error");
        assert_eq!(err["error"]["code"], "request_too_large");
    }
    let ok = c
        .post(proxy.url(CHAT))
        .body(sized_body(90_000))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_are_routed_by_fallback_and_leak_nothing() {
    let ups = upstreams::<2>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let bodies: Vec<Vec<u8>> = vec![
        b"not json at all".to_vec(),
        b"{\"messages\": [".to_vec(),
        vec![0xff, 0xfe, 0x00, 0x7b],
        format!("{}1{}", "[".repeat(10_000), "]".repeat(10_000)).into_bytes(),
        br#"{"messages":"wrong shape"}"#.to_vec(),
    ];
    let mut by_body: HashMap<usize, String> = HashMap::new();
    for (i, b) in bodies.iter().enumerate() {
        let r = c
            .post(proxy.url(CHAT))
            .body(b.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let echo: serde_json::Value = r.json().await.unwrap();
        assert_eq!(echo["sha256"], sha256_hex(b).as_str());
        by_body.insert(i, echo["upstream"].as_str().unwrap().to_owned());
    }
    // Fallback is the client address: one client, one peer.
    assert_eq!(by_body.values().collect::<HashSet<_>>().len(), 1);
    proxy.assert_idle().await;
}

/// A key path renamed in the configuration is forwarded, whatever the allowlist says.
#[test]
fn renamed_key_paths_are_allowed() {
    let settings = prefixlb::config::parse(
        "peers: [{addr: \"127.0.0.1:1\"}]\nrouting: {key: {chat_path: /my/chat}}\n",
    )
    .unwrap();
    let allowed = settings.proxy.forwarding.allowed_paths.unwrap();
    assert!(allowed.iter().any(|p| p == "/my/chat"), "{allowed:?}");
}

#[test]
fn invalid_configs_are_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "peers: [{addr: \"127.0.0.1:1\", wieght: 2}]",
            "peers[0].wieght",
        ),
        ("routing: {balance_factor: 0.5}", "routing.balance_factor"),
        ("peers: [{addr: \"not an address\"}]", "peers[0].addr"),
        ("queue: {max_waiting: -1}", "queue.max_waiting"),
        ("listen: [\"127.0.0.1:99999\"]", "listen[0]"),
        ("admin: {listen: \"0.0.0.0:9090\"}", "admin.listen"),
        (
            "peers: [{addr: \"127.0.0.1:1\"}, {addr: \"127.0.0.1:2\", weight: 0}]",
            "peers[1].weight",
        ),
        (
            "forwarding: {request_id_header: content-length}",
            "forwarding.request_id_header",
        ),
        (
            "forwarding: {trusted_proxies: [10.0.0.0/33]}",
            "forwarding.trusted_proxies[0]",
        ),
        (
            "limits: {peek_memory_bytes: 1000}",
            "limits.peek_memory_bytes",
        ),
        (
            "listen: [{addr: \"127.0.0.1:8443\", tls: {cert: /no/cert.pem, key: /no/key.pem}}]",
            "listen[0].tls.cert",
        ),
        ("auth: {keys_file: /no/keys.yaml}", "auth.keys_file"),
        (
            "replicas: {listen: \"127.0.0.1:7300\", others: []}",
            "replicas.others",
        ),
        (
            "replicas: {listen: \"127.0.0.1:7300\", others: [\"10.0.0.2\"]}",
            "replicas.others[0]",
        ),
        ("peers: [{addr: \"127.0.0.1:1\", sni: x}]", "peers[0].sni"),
        (
            "discovery: {redis: {url: \"http://x\"}}",
            "discovery.redis.url",
        ),
        (
            "discovery: {redis: {url: \"redis://127.0.0.1:1\"}, dns: {name: x, port: 1}}",
            "discovery",
        ),
        // `-t` asks the registry, which does not answer on port 1.
        (
            "discovery: {redis: {url: \"redis://127.0.0.1:1\"}}",
            "discovery.redis",
        ),
    ]
    .map(|(yaml, field)| (yaml.to_owned(), field));
    // Files that exist but hold no certificate, no CA, or a bad key entry.
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not PEM at all").unwrap();
    let keys = dir.path().join("keys.yaml");
    std::fs::write(&keys, "keys: [{name: a, sha256: abc}]").unwrap();
    let (junk, keys) = (junk.display(), keys.display());
    let files = [
        (
            format!("listen: [{{addr: \"127.0.0.1:8443\", tls: {{cert: \"{junk}\", key: \"{junk}\"}}}}]"),
            "tls.cert",
        ),
        (
            format!("upstream: {{tls: {{ca_file: \"{junk}\"}}}}"),
            "upstream.tls.ca_file",
        ),
        (format!("auth: {{keys_file: \"{keys}\"}}"), "keys[0]"),
    ];
    for (yaml, field) in cases.into_iter().chain(files) {
        let path = dir.path().join("bad.yaml");
        std::fs::write(&path, &yaml).unwrap();
        let out = std::process::Command::new(binary())
            .arg("-l")
            .arg(&path)
            .arg("-t")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{yaml} was accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(field), "{yaml}: {stderr}");
    }
    let ok = std::process::Command::new(binary())
        .args(["-l", "conf/prefixlb.yaml", "-c", "conf/pingora.yaml", "-t"])
        .output()
        .unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_for_want_of_a_slot_reaches_a_client_still_sending_its_body() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(0)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let c = client();
    let held = open_stream(&proxy, 30, 100).await;
    // A 20 MB prompt: the key is read from its first bytes, the rest is still unsent when the
    // 503 is answered.
    let long = chat(&"long system prompt ".repeat(1_100_000), "q", 1, false);
    for _ in 0..3 {
        let r = c
            .post(proxy.url(CHAT))
            .header("x-session-id", "another")
            .body(long.clone())
            .send()
            .await
            .expect("the 503 must arrive, not a reset");
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()["retry-after"], "1");
    }
    drop(held);
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_client_leaves_leaves_the_line_at_once() {
    use tokio::io::AsyncWriteExt;
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(4)
        .queue_timeout_ms(10000)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let held = open_stream(&proxy, 10, 100).await;
    let body = chat("s", "the one who leaves", 1, false);
    let mut leaving = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    leaving
        .write_all(
            format!(
                "POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let waiting = |l: &serde_json::Value| l["waiting"].as_u64().unwrap();
    let start = Instant::now();
    while waiting(&proxy.peers().await) == 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "it never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(leaving);
    let left = Instant::now();
    while waiting(&proxy.peers().await) != 0 {
        assert!(
            left.elapsed() < Duration::from_millis(500),
            "the gone client kept its place"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    held.text().await.unwrap();
    proxy.assert_idle().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        up.seen().len(),
        1,
        "the gone client's request went upstream"
    );
}

/// Sends `head` (a request line and headers, without the blank line) and `body` on a raw
/// connection; returns the response's status code.
async fn raw_status(proxy: &Proxy, head: &str, body: &[u8]) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(format!("{head}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    // The answer may come before the whole body is taken: a refused write is fine.
    let _ = s.write_all(body).await;
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    while !response.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => response.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&response);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_content_length_is_a_length() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_body_bytes(100000)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let head = |n: usize| format!("POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: {n}, {n}");
    let big = sized_body(150_000);
    assert_eq!(raw_status(&proxy, &head(big.len()), &big).await, 413);
    let fits = sized_body(90_000);
    assert_eq!(raw_status(&proxy, &head(fits.len()), &fits).await, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].sha256,
        sha256_hex(&fits),
        "the body went upstream changed"
    );
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_trickles_in_gets_408_at_the_peek_deadline() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .peek_timeout_ms(500)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let start = Instant::now();
    // Ten bytes of a thousand, then nothing: each read waits far less than Pingora's 60 s.
    let head = format!("POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-length: 1000");
    assert_eq!(raw_status(&proxy, &head, b"{\"messages").await, 408);
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert!(up.seen().is_empty(), "a body that never came went upstream");
    proxy.assert_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_see_who_asked_and_the_request_id_goes_both_ways() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up]).access_log("plain")).await;
    let c = client();
    let sent = c
        .post(proxy.url(CHAT))
        .header("x-forwarded-for", "203.0.113.9")
        .header("x-forwarded-proto", "https")
        .header("x-request-id", "client-id-1")
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(sent.headers()["x-request-id"], "client-id-1");
    let made = c
        .post(proxy.url(CHAT))
        .header("x-request-id", "not usable: spaces")
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    let made_id = made.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(made_id.len(), 32, "{made_id}");
    let seen = up.seen();
    let h = &seen[0].headers;
    assert_eq!(
        h["x-forwarded-for"], "127.0.0.1",
        "a stranger's chain was kept"
    );
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-request-id"], "client-id-1");
    assert_eq!(seen[1].headers["x-request-id"], made_id.as_str());
    proxy.assert_idle().await;
    let log = proxy.access_log_when(|l| l.lines().count() >= 2).await;
    assert!(log.contains("request_id=client-id-1"), "{log}");
    assert!(log.contains(&format!("request_id={made_id}")), "{log}");

    let trusting = start_proxy(
        &TestConfig::new()
            .peers(&[&up])
            .trusted_proxies(&["127.0.0.0/8"]),
    )
    .await;
    c.post(trusting.url(CHAT))
        .header("x-forwarded-for", "203.0.113.9")
        .header("x-forwarded-proto", "https")
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    let h = &up.seen()[2].headers;
    assert_eq!(h["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "https");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_own_controls_are_not_reachable_through_the_balancer() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let c = client();
    for path in [
        "/start_profile",
        "/reset_prefix_cache",
        "/v1/load_lora_adapter",
        "/metrics",
    ] {
        let r = c
            .post(proxy.url(path))
            .header("x-request-id", "refused-1")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{path}");
        assert_eq!(
            r.headers()["x-request-id"],
            "refused-1",
            "an answer of prefixlb's own without the request id"
        );
        let err: serde_json::Value = r.json().await.unwrap();
        assert_eq!(err["error"]["code"], "unknown_url", "{path}");
    }
    assert!(up.seen().is_empty(), "{:?}", up.seen());
    let r = c.get(proxy.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let open = start_proxy(&TestConfig::new().peers(&[&up]).forward_every_path()).await;
    let r = c
        .post(open.url("/start_profile"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "allowed_paths: null forwards every path");
}

/// A model list or a health probe is not a prompt: it neither waits for nor is refused a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_list_is_answered_while_every_slot_is_taken() {
    let up = start_upstream("a").await;
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(0)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let held = open_stream(&proxy, 30, 100).await;
    let c = client();
    let prompt = post_chat(&c, &proxy, chat("s", "q", 1, false)).await;
    assert_eq!(prompt.status(), 503, "the cluster is not full");
    let r = c.get(proxy.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    drop(held);
    proxy.assert_idle().await;
}

/// Everything the proxy sends on one connection after `request` is written, until it closes
/// (or 5 s pass).
async fn raw_exchange(proxy: &Proxy, request: &[u8]) -> String {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(request).await.unwrap();
    read_to_close(&mut s).await
}

/// A 1.0 client cannot read chunked framing: a stream of unknown length reaches it delimited
/// by the close, as HTTP/1.0 has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_client_gets_its_stream_close_delimited() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let body = chat("s", "an old client", 1, true);
    let request = format!(
        "POST {CHAT} HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nx-mock-events: 3\r\nx-mock-interval-ms: 20\r\n\r\n{body}",
        body.len()
    );
    let got = raw_exchange(&proxy, request.as_bytes()).await;
    let (head, rest) = got.split_once("\r\n\r\n").expect("a whole head");
    let head = head.to_ascii_lowercase();
    assert!(
        head.starts_with("http/1.0 200") || head.starts_with("http/1.1 200"),
        "{got}"
    );
    assert!(
        !head.contains("transfer-encoding"),
        "chunked to a 1.0 client: {got}"
    );
    assert!(!head.contains("keep-alive"), "{got}");
    assert!(
        rest.starts_with("data: {\"i\":0"),
        "framing in the body: {got:?}"
    );
    assert!(rest.ends_with("data: [DONE]\n\n"), "{got:?}");
    proxy.assert_idle().await;
}

/// Requests sent back to back on one connection, before any answer is read, are each answered,
/// in order (RFC 9112 §9.3.2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_are_answered_in_order() {
    let up = start_upstream("a").await;
    // One slot, taken for a while: the first request waits in line while the others are
    // already in the proxy's read buffer, which watching for the client's close must not eat.
    let cfg = TestConfig::new()
        .peers(&[&up])
        .max_in_flight(1)
        .max_waiting(4)
        .queue_timeout_ms(10000)
        .no_health_check();
    let proxy = start_proxy(&cfg).await;
    let held = open_stream(&proxy, 5, 100).await;
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(held);
    });
    let bodies: Vec<String> = (0..3)
        .map(|i| chat("s", &format!("pipelined {i}"), 1, false))
        .collect();
    let requests: String = bodies
        .iter()
        .enumerate()
        .map(|(i, body)| {
            let last = if i == bodies.len() - 1 { "Connection: close\r\n" } else { "" };
            format!(
                "POST {CHAT} HTTP/1.1\r\nHost: x\r\n{last}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
        })
        .collect();
    let got = raw_exchange(&proxy, requests.as_bytes()).await;
    assert_answered_in_order(&got, &bodies);
    release.await.unwrap();
    proxy.assert_idle().await;
}
