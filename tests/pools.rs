//! Pools by model: peers listed with their models or asked for them, requests routed to a peer
//! that serves theirs, 404 for a model nobody serves, and the union at `/v1/models`.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::*;

fn chat_for(model: &str, system: &str, model_last: bool) -> String {
    let messages = serde_json::json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "q"}
    ]);
    // OpenAI's clients may send `model` after `messages`: it is found there too.
    if model_last {
        format!(r#"{{"messages":{messages},"stream":false,"model":"{model}"}}"#)
    } else {
        format!(r#"{{"model":"{model}","messages":{messages},"stream":false}}"#)
    }
}

#[tokio::test]
async fn requests_go_to_a_peer_that_serves_their_model() {
    let [a, b, c] = upstreams::<3>().await;
    // a is listed with a base model and a LoRA adapter on it; b says what it serves when
    // asked; c serves another base model and is listed.
    b.models.lock().unwrap().extend(["base-b".to_owned()]);
    let proxy = start_proxy(
        &TestConfig::new()
            .peer(PeerEntry::at(a.addr).models(&["base-a", "sql-lora"]))
            .peer(PeerEntry::at(b.addr))
            .peer(PeerEntry::at(c.addr).models(&["base-c"]))
            .discover_models(100)
            .default_model("base-c")
            .no_health_check(),
    )
    .await;
    // Until b has said, it may serve anything; wait for its list.
    let start = Instant::now();
    loop {
        let listing: serde_json::Value = client()
            .get(proxy.url("/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let ids: Vec<&str> = listing["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap())
            .collect();
        if ids == ["base-a", "base-b", "base-c", "sql-lora"] {
            assert_eq!(listing["object"], "list");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "models: {ids:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let expected = [
        ("base-a", "a"),
        ("sql-lora", "a"),
        ("base-b", "b"),
        ("base-c", "c"),
    ];
    for (model, upstream) in expected {
        let mut served = HashSet::new();
        for i in 0..12 {
            // A session named in a header is still routed by the model its body asks for.
            let answer = client()
                .post(proxy.url("/v1/chat/completions"))
                .header("x-session-id", format!("session {}", i % 3))
                .body(chat_for(model, &format!("conversation {i}"), i % 2 == 0))
                .send()
                .await
                .unwrap();
            assert_eq!(answer.status(), 200);
            served.insert(answer.headers()["x-upstream"].to_str().unwrap().to_owned());
        }
        assert_eq!(served, HashSet::from([upstream.to_owned()]), "{model}");
    }
    // No model: the default pool.
    let answer = client()
        .post(proxy.url("/v1/chat/completions"))
        .body(chat("s", "q", 1, false).replace(r#""model":"m","#, ""))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.headers()["x-upstream"], "c");

    let seen = a.seen().len() + b.seen().len() + c.seen().len();
    let unknown = client()
        .post(proxy.url("/v1/chat/completions"))
        .body(chat_for("gpt-nope", "s", true))
        .send()
        .await
        .unwrap();
    assert_eq!(unknown.status(), 404);
    let json: serde_json::Value = unknown.json().await.unwrap();
    assert_eq!(json["error"]["code"], "model_not_found");
    assert_eq!(a.seen().len() + b.seen().len() + c.seen().len(), seen);
    let listing = proxy.peers().await;
    assert_eq!(
        listing["peers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["address"] == b.addr_str())
            .unwrap()["models"],
        serde_json::json!(["base-b"])
    );
    let metrics = proxy.metrics().await;
    assert!(
        metrics.contains("prefixlb_pool_peers{model=\"sql-lora\"} 1"),
        "{metrics}"
    );
    assert!(metrics.contains("prefixlb_pool_peers{model=\"base-b\"} 1"));
    proxy.assert_idle().await;
}

/// A model whose peers are all busy holds up no other model: a request for another model is
/// neither queued behind its waiters nor refused because they fill the line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_model_holds_up_no_other_model() {
    let [a, b] = upstreams::<2>().await;
    let proxy = start_proxy(
        &TestConfig::new()
            .peer(PeerEntry::at(a.addr).models(&["model-a"]).max_in_flight(1))
            .peer(PeerEntry::at(b.addr).models(&["model-b"]))
            .max_waiting(1)
            .queue_timeout_ms(8_000)
            .no_health_check(),
    )
    .await;
    let send = |model: &'static str, conversation: &'static str| {
        let url = proxy.url("/v1/chat/completions");
        tokio::spawn(async move {
            let start = Instant::now();
            let answer = client()
                .post(url)
                .body(chat_for(model, conversation, false))
                .send()
                .await
                .unwrap();
            (answer.status(), start.elapsed())
        })
    };
    // model-a's only slot, held for three seconds by a slow stream; a second request for
    // model-a fills the line.
    let holder = client()
        .post(proxy.url("/v1/chat/completions"))
        .header("x-mock-events", "60")
        .header("x-mock-interval-ms", "50")
        .body(chat_for("model-a", "holder", false))
        .send()
        .await
        .unwrap();
    let waiter = send("model-a", "waiter");
    let start = Instant::now();
    while proxy.peers().await["waiting"] != 1 {
        assert!(start.elapsed() < Duration::from_secs(2), "never waited");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for i in 0..3 {
        let (status, took) = send("model-b", ["b0", "b1", "b2"][i]).await.unwrap();
        assert_eq!(status, 200, "model-b refused behind model-a's line");
        assert!(
            took < Duration::from_millis(1_000),
            "model-b waited behind model-a: {took:?}"
        );
    }
    assert!(!waiter.is_finished(), "model-a's waiter passed a held slot");
    let _ = holder.bytes().await.unwrap();
    let (status, took) = waiter.await.unwrap();
    assert_eq!(status, 200);
    assert!(took >= Duration::from_millis(500), "{took:?}");
    proxy.assert_idle().await;
}
