//! Engines that misbehave, through the real binary: one that takes requests and sends nothing
//! (wedged), one whose stream stalls half-way, one killed in the middle of a stream, one that
//! answers what is not HTTP, one that sends a byte at a time. The engines are mocks written
//! on raw sockets (an engine is a peer we do not own), so that each can break HTTP exactly as
//! a failing server does.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::dns::*;
use common::*;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// What a mock engine does with one `POST`, given the connection after the request was read.
type Answer = Arc<dyn Fn(TcpStream) -> tokio::task::JoinHandle<()> + Send + Sync>;

struct Engine {
    addr: SocketAddr,
    /// `POST`s it took.
    posts: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An engine that answers `GET`s (health checks) with 200 and hands each `POST` to `answer`.
async fn engine(answer: Answer) -> Engine {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let posts = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&posts);
    let task = tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else {
                return;
            };
            let (answer, posts) = (Arc::clone(&answer), Arc::clone(&counted));
            tokio::spawn(async move { serve(conn, answer, posts).await });
        }
    });
    Engine { addr, posts, task }
}

/// Reads requests off one connection: `GET`s answered at once, kept alive; a `POST` (body
/// read by its length) handed over with the connection.
async fn serve(conn: TcpStream, answer: Answer, posts: Arc<AtomicUsize>) {
    let mut reader = BufReader::new(conn);
    loop {
        let mut head = Vec::new();
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
                return;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            if line == "\r\n" {
                break;
            }
            head.push(line);
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).await.is_err() {
            return;
        }
        if head.first().is_some_and(|l| l.starts_with("POST")) {
            posts.fetch_add(1, Ordering::SeqCst);
            answer(reader.into_inner());
            return;
        }
        let ok = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        if reader.get_mut().write_all(ok.as_bytes()).await.is_err() {
            return;
        }
    }
}

const SSE_HEAD: &str =
    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

fn chunk(data: &str) -> Vec<u8> {
    format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()
}

fn event(text: &str) -> String {
    format!("data: {{\"choices\":[{{\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n")
}

/// A whole stream of `events` events then `[DONE]`, each `gap` apart, after `first` (the
/// prefill).
async fn stream(mut conn: TcpStream, events: usize, first: Duration, gap: Duration) {
    let _ = conn.write_all(SSE_HEAD.as_bytes()).await;
    tokio::time::sleep(first).await;
    for i in 0..events {
        let _ = conn.write_all(&chunk(&event(&format!("t{i}")))).await;
        tokio::time::sleep(gap).await;
    }
    let _ = conn.write_all(&chunk("data: [DONE]\n\n")).await;
    let _ = conn.write_all(b"0\r\n\r\n").await;
}

fn streams(events: usize, first: Duration, gap: Duration) -> Answer {
    Arc::new(move |conn| tokio::spawn(stream(conn, events, first, gap)))
}

/// Reads a whole streamed answer through the proxy: its body and whether it ended cleanly.
async fn read_stream(proxy: &Proxy, conversation: &str) -> (String, Result<(), String>) {
    let r = client()
        .post(proxy.url("/v1/chat/completions"))
        .body(chat(conversation, "q", 1, true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = String::new();
    let mut r = r;
    loop {
        match r.chunk().await {
            Ok(Some(c)) => body.push_str(&String::from_utf8_lossy(&c)),
            Ok(None) => return (body, Ok(())),
            Err(e) => return (body, Err(format!("{e:?}"))),
        }
    }
}

/// The `error` object of the stream's last event, if it is an error event.
fn error_event(body: &str) -> Option<serde_json::Value> {
    let last = body.trim_end().rsplit("\n\n").next()?;
    let v: serde_json::Value = serde_json::from_str(last.strip_prefix("data: ")?).ok()?;
    v.get("error").cloned()
}

fn peer_entry(listing: &serde_json::Value, addr: SocketAddr) -> serde_json::Value {
    listing["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["address"] == addr.to_string())
        .cloned()
        .unwrap_or_else(|| panic!("{addr} not listed: {listing}"))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stalls_half_way_ends_with_an_error_event_and_frees_its_slot() {
    let stalling: Answer = Arc::new(|mut conn| {
        tokio::spawn(async move {
            let _ = conn.write_all(SSE_HEAD.as_bytes()).await;
            for i in 0..2 {
                let _ = conn.write_all(&chunk(&event(&format!("t{i}")))).await;
            }
            // Then silence, the connection open, for longer than the test.
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
    let started = Instant::now();
    let (body, end) = read_stream(&proxy, "stalls").await;
    let took = started.elapsed();
    assert!(
        end.is_ok(),
        "the stream did not end cleanly: {end:?}, {body}"
    );
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
    assert!(end.is_ok(), "{end:?}: {body}");
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
            let body = String::from_utf8_lossy(&r.bytes().await.unwrap()).into_owned();
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
