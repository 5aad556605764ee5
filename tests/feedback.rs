//! What prefixlb learns from the engines' answers, through the real binary: the prefill rate
//! from first bytes, and the engine's own cached-token report checked against the record.
//!
//! The engine is a mock (an engine is a peer we do not own) with a real prefix cache: it
//! counts a prompt's tokens as its characters over four, finds the longest prefix it has
//! served, takes 10 ms plus the rest at a fixed rate to its first byte, and says in its usage
//! what it had cached, as vLLM does.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::response::IntoResponse;
use common::*;
use serde_json::{json, Value};

/// The mock engine's prefill rate, in its tokens (four characters) a second.
const RATE: f64 = 20_000.0;

#[derive(Default)]
struct Cache {
    prompts: Mutex<Vec<String>>,
    /// Drops everything it holds before the next request, once.
    evict: AtomicBool,
    /// The prompt and cached tokens its usage reports said, summed.
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
}

struct Engine {
    addr: SocketAddr,
    cache: Arc<Cache>,
}

async fn engine() -> Engine {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cache = Arc::new(Cache::default());
    let app = axum::Router::new()
        .route("/v1/chat/completions", axum::routing::post(answer))
        // Health checks and the rest.
        .fallback(|| async { "ok" })
        .with_state(Arc::clone(&cache));
    tokio::spawn(async move { axum::serve(listener, app).await });
    Engine { addr, cache }
}

async fn answer(State(cache): State<Arc<Cache>>, body: axum::Json<Value>) -> impl IntoResponse {
    let text: String = body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["content"].as_str())
        .collect();
    let cached_chars = {
        let mut prompts = cache.prompts.lock().unwrap();
        if cache.evict.swap(false, Ordering::Relaxed) {
            prompts.clear();
        }
        let common = |p: &String| {
            p.bytes()
                .zip(text.bytes())
                .take_while(|(a, b)| a == b)
                .count()
        };
        let best = prompts.iter().map(common).max().unwrap_or(0);
        prompts.push(text.clone());
        best
    };
    let (tokens, cached) = (text.len() / 4, cached_chars / 4);
    cache
        .prompt_tokens
        .fetch_add(tokens as u64, Ordering::Relaxed);
    cache
        .cached_tokens
        .fetch_add(cached as u64, Ordering::Relaxed);
    let prefill = (tokens - cached) as f64 / RATE;
    tokio::time::sleep(Duration::from_secs_f64(0.01 + prefill)).await;
    axum::Json(json!({
        "id": "x",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1,
                  "prompt_tokens_details": {"cached_tokens": cached}},
    }))
}

async fn chat(proxy: &Proxy, messages: &[String]) {
    let messages: Vec<Value> = messages
        .iter()
        .enumerate()
        .map(|(i, content)| {
            let role = match i {
                0 => "system",
                i if i % 2 == 1 => "user",
                _ => "assistant",
            };
            json!({"role": role, "content": content})
        })
        .collect();
    let body = json!({"model": "m", "messages": messages});
    let r = reqwest::Client::new()
        .post(proxy.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.bytes().await.unwrap();
}

/// The counter `name` summed over the peers.
async fn total(proxy: &Proxy, name: &str) -> f64 {
    proxy
        .metrics()
        .await
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn text(letter: char, chars: usize, salt: usize) -> String {
    format!("{salt} {}", letter.to_string().repeat(chars))
}

#[tokio::test]
async fn the_prefill_rate_is_learned_from_a_start_two_and_a_half_times_off() {
    let e = engine().await;
    let proxy = start_proxy(
        &TestConfig::new()
            .peers_at([e.addr])
            .prefill_tokens_per_second(RATE * 2.5),
    )
    .await;
    for i in 0..16 {
        // Distinct prompts of 2,000 to 8,000 tokens: nothing cached.
        let size = 8_000 + (i % 4) * 8_000;
        chat(&proxy, &[text('s', size, i), text('q', 100, i)]).await;
    }
    proxy.assert_idle().await;
    let peers = proxy.peers().await;
    let rate = peers["peers"][0]["prefill_tokens_per_second"]
        .as_f64()
        .unwrap_or_else(|| panic!("no rate learned: {peers}"));
    assert!(
        (rate / RATE - 1.0).abs() < 0.2,
        "learned {rate}, true {RATE}"
    );
    let gauge = total(&proxy, "prefixlb_peer_prefill_tokens_per_second").await;
    assert!((gauge - rate).abs() < 1.0, "{gauge} against {rate}");
}

#[tokio::test]
async fn an_engine_that_evicted_a_conversation_gets_its_next_turn_priced_cold() {
    let (a, b) = (engine().await, engine().await);
    let proxy = start_proxy(
        &TestConfig::new()
            .peers_at([a.addr, b.addr])
            .advanced("eviction_margin", "0.25"),
    )
    .await;
    const PREDICTED: &str = "prefixlb_peer_predicted_cached_tokens_total";
    const REPORTED: &str = "prefixlb_peer_reported_cached_tokens_total";
    const PROMPT: &str = "prefixlb_peer_usage_prompt_tokens_total";
    // Two conversations of three turns: (system, question), then an answer and a question
    // more each turn. Before the second turn of the first, both engines drop their caches.
    let mut predicted_third = Vec::new();
    for (conversation, evict) in [(1, true), (2, false)] {
        let mut messages = vec![text('s', 4_000, conversation), text('q', 1_000, 0)];
        for turn in 1..=3 {
            if turn == 2 && evict {
                a.cache.evict.store(true, Ordering::Relaxed);
                b.cache.evict.store(true, Ordering::Relaxed);
            }
            let (predicted, prompt) = (total(&proxy, PREDICTED).await, total(&proxy, PROMPT).await);
            chat(&proxy, &messages).await;
            proxy.assert_idle().await;
            let predicted = total(&proxy, PREDICTED).await - predicted;
            let prompt = total(&proxy, PROMPT).await - prompt;
            assert!(prompt > 0.0, "the usage was read");
            if turn == 3 {
                predicted_third.push(predicted / prompt);
            }
            messages.push(text('a', 8_000, turn));
            messages.push(text('q', 500, turn));
        }
    }
    let misses = total(&proxy, "prefixlb_peer_cache_misses_total").await;
    assert_eq!(misses, 1.0, "the first conversation's second turn");
    // The third turn of the evicted conversation is priced as holding its key alone there
    // (a quarter of the prompt); the other's as holding its history (three fifths).
    let (evicted, kept) = (predicted_third[0], predicted_third[1]);
    assert!(evicted < 0.3, "evicted conversation predicted {evicted}");
    assert!(kept > 0.5, "kept conversation predicted {kept}");
    // What the engines reported is what prefixlb counted, token for token.
    let said = |count: fn(&Cache) -> &AtomicU64| {
        [&a, &b]
            .iter()
            .map(|e| count(&e.cache).load(Ordering::Relaxed) as f64)
            .sum::<f64>()
    };
    let reported = said(|c| &c.cached_tokens);
    assert!(reported > 0.0, "the kept conversation's turns were cached");
    assert_eq!(total(&proxy, REPORTED).await, reported);
    assert_eq!(total(&proxy, PROMPT).await, said(|c| &c.prompt_tokens));
}
