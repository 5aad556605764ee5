//! Request bodies: they reach the upstream byte for byte whatever their size and framing, and
//! turns longer than the peek window stay with their conversation.

use std::collections::HashSet;

use crate::common::*;
use crate::{framed, sized_body, Framing, CHAT};

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
