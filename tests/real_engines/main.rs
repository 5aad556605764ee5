//! prefixlb in front of two real llama.cpp engines (`llama-server`, a tiny random-weight Llama
//! on the CPU): real prefill, real KV-cache reuse, real streaming and real metrics pages. The
//! engines come from `tests/real_engines/setup.sh` (see `llama.rs` for where they are looked for).
//! Run with `--nocapture` to see the times measured.

mod cluster;
#[path = "../common/mod.rs"]
mod common;
mod llama;
mod stream;

use std::time::{Duration, Instant};

use cluster::Cluster;
use llama::{Setup, MODEL};
use serde_json::{json, Value};
use stream::Reply;

/// One test at a time: the engines of two tests at once would share the machine's two cores
/// and every time measured here.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A system prompt of about 2,300 tokens, its own for each `topic`.
fn system_prompt(topic: &str) -> String {
    let desks = [
        "billing", "returns", "shipping", "accounts", "repairs", "sales",
    ];
    let mut prompt = format!("You are the {topic} assistant of a hardware shop. Rules:\n");
    for i in 0..100 {
        prompt += &format!(
            "{i}. A {topic} question about the {} desk is answered within {} minutes.\n",
            desks[i % desks.len()],
            5 + i * 3
        );
    }
    prompt
}

fn message(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_returns_to_the_engine_that_caches_it_and_a_new_prefix_goes_to_its_primary()
{
    let setup = Setup::find();
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let cluster = Cluster::start(&setup).await;

    // Turn 1: no engine holds any of it.
    let mut conversation = vec![
        message("system", &system_prompt("billing")),
        message("user", "How long does a refund take?"),
    ];
    let first = cluster.chat(&conversation, 8).await;
    assert!(first.done, "turn 1 did not finish: {first:?}");
    let home = cluster.served(1).await;
    assert!(
        first.prompt > 1000,
        "a system prompt of {} tokens",
        first.prompt
    );

    // Turn 2 resends the history: same engine, which reuses what it holds of turn 1.
    conversation.push(message("assistant", &first.text));
    conversation.push(message("user", "And for an exchange?"));
    let second = cluster.chat(&conversation, 8).await;
    assert!(second.done, "turn 2 did not finish: {second:?}");
    assert_eq!(cluster.served(2).await, home, "turn 2 left its engine");
    assert!(
        second.cached as f64 >= 0.9 * first.prompt as f64,
        "turn 2 found {} of turn 1's {} prompt tokens cached",
        second.cached,
        first.prompt
    );

    // A new conversation on the same system prompt goes where that prompt is cached.
    let same_prompt = vec![
        message("system", &system_prompt("billing")),
        message("user", "Can I pay by card?"),
    ];
    let third = cluster.chat(&same_prompt, 8).await;
    assert_eq!(
        cluster.served(3).await,
        home,
        "the record's engine was passed over"
    );
    assert!(
        third.cached as f64 >= 0.9 * third.prompt as f64,
        "the shared system prompt was prefilled again: {} of {} cached",
        third.cached,
        third.prompt
    );

    // One on another system prompt is cold everywhere: it goes to its own primary (the ring's
    // choice, on an idle cluster), where the engine prefills all of it.
    let other_prompt = vec![
        message("system", &system_prompt("shipping")),
        message("user", "Do you ship abroad?"),
    ];
    let fourth = cluster.chat(&other_prompt, 8).await;
    let line = &cluster.chats_logged(4).await[3];
    assert_eq!(line["route"], "primary", "{line}");
    assert!(
        (fourth.cached as f64) < 0.1 * fourth.prompt as f64,
        "a prompt no engine held was found cached: {fourth:?}"
    );
    cluster.proxy.assert_idle().await;
    // prefixlb read llama.cpp's own usage from the streams: the engine's counts are its.
    let cache = &cluster.peer(&home).await["cache"];
    let engine_cached = second.cached
        + third.cached
        + if home == cluster.served(4).await {
            fourth.cached
        } else {
            0
        };
    assert_eq!(
        cache["reported_cached_tokens"].as_u64(),
        Some(first.cached + engine_cached),
        "{cache}"
    );
    let times = |r: &Reply| format!("{:?} (the engine's prefill {:.0} ms)", r.ttft, r.prefill_ms);
    println!(
        "TTFT through prefixlb, {} prompt tokens: cold {}; warm (turn 2, {} cached) {}; \
         same system prompt {}; other system prompt {}; test {:?}",
        first.prompt,
        times(&first),
        second.cached,
        times(&second),
        times(&third),
        times(&fourth),
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefixlb_reads_running_and_queued_requests_from_llama_cpp_metrics() {
    let setup = Setup::find();
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(&setup).await;
    let (busy, idle) = (cluster.engines[0].addr_str(), cluster.engines[1].addr_str());

    // Three long streams sent to the engine directly, past prefixlb: two slots run, one waits
    // (its response head comes with its first token, so each is read in a task of its own).
    let direct: Vec<_> = (0..3)
        .map(|i| {
            let url = cluster.engines[0].url("/v1/chat/completions");
            let body = json!({
                "model": MODEL,
                "messages": [message("user", &format!("Count to a thousand, {i}."))],
                "max_tokens": 2000,
                "ignore_eos": true,
                "stream": true,
            });
            tokio::spawn(async move {
                stream::read(stream::post(&url, &body).await, Instant::now()).await
            })
        })
        .collect();
    let page = cluster.engines[0].metrics().await;
    assert!(page.contains("llamacpp:requests_processing"), "{page}");
    cluster
        .until_peer(&busy, Duration::from_secs(10), |p| {
            p["engine"]["running"] == 2 && p["engine"]["waiting"] == 1 && p["external"] == 3
        })
        .await;
    assert_eq!(cluster.peer(&busy).await["in_flight"], 0);
    cluster
        .until_peer(&idle, Duration::from_secs(2), |p| {
            p["engine"]["running"] == 0 && p["external"] == 0
        })
        .await;
    // llama.cpp has no KV-use gauge.
    assert_eq!(
        cluster.peer(&busy).await["engine"]["kv_cache_usage"],
        Value::Null
    );

    // The clients go: the engine ends their streams, and says so.
    for client in direct {
        client.abort();
    }
    cluster
        .until_peer(&busy, Duration::from_secs(30), |p| {
            p["engine"]["running"] == 0 && p["engine"]["waiting"] == 0 && p["external"] == 0
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_mid_stream_ends_the_stream_frees_the_slot_and_the_next_turn_goes_on() {
    let setup = Setup::find();
    let _serial = SERIAL.lock().await;
    let mut cluster = Cluster::start(&setup).await;
    let mut conversation = vec![
        message("system", &system_prompt("repairs")),
        message("user", "My drill stopped. What now?"),
    ];
    let first = cluster.chat(&conversation, 4).await;
    assert!(first.done, "{first:?}");
    let home = cluster.served(1).await;
    conversation.push(message("assistant", &first.text));
    conversation.push(message("user", "It still does not turn."));

    // Turn 2 streams a long answer; its engine dies after a few tokens.
    let body = json!({
        "model": MODEL,
        "messages": conversation,
        "max_tokens": 2000,
        "ignore_eos": true,
        "stream": true,
    });
    let start = Instant::now();
    let response = stream::post(&cluster.proxy.url("/v1/chat/completions"), &body).await;
    let cut = stream::read_with(response, start, 3, || cluster.engine_mut(&home).kill()).await;
    assert!(!cut.done, "the stream ended as if whole: {cut:?}");
    // prefixlb ends it with an error event the client reads before the cut, not a bare cut.
    assert!(
        cut.error
            .as_deref()
            .is_some_and(|e| e.contains("upstream_error")),
        "the stream ended without an error event: {cut:?}"
    );
    assert!(cut.events >= 3, "{cut:?}");
    cluster.proxy.assert_idle().await;

    // The next turn is served, by the other engine.
    let again = cluster.chat(&conversation, 4).await;
    assert!(again.done, "{again:?}");
    let other = cluster.other(&home);
    assert_eq!(cluster.served(3).await, other);
    cluster
        .until_peer(&home, Duration::from_secs(5), |p| p["healthy"] == false)
        .await;
    println!(
        "killed mid-stream after {} events (error: {:?}); next turn on the other engine, TTFT {:?}",
        cut.events, cut.error, again.ttft
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_python_client_streams_a_chat_and_a_completion_through_prefixlb() {
    let setup = Setup::find();
    let _serial = SERIAL.lock().await;
    let cluster = Cluster::start(&setup).await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/real_engines/openai_client.py"
    );
    let output = std::process::Command::new(setup.python())
        .arg(script)
        .arg(cluster.proxy.url("/v1"))
        .arg(MODEL)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "the openai client failed: {}\n{}",
        String::from_utf8_lossy(&output.stderr),
        cluster.proxy.log()
    );
    let got: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(got["models"], json!([MODEL]), "{got}");
    assert!(got["chat_chunks"].as_u64().unwrap() >= 2, "{got}");
    assert!(got["completion_chunks"].as_u64().unwrap() >= 2, "{got}");
    let log = cluster
        .proxy
        .access_log_when(|l| l.contains("/v1/completions"))
        .await;
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let served = log
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|l| l["path"] == path && l["status"] == 200 && l["peer"].is_string());
        assert!(served, "no line for {path} served by an engine: {log}");
    }
    println!("openai {}: {got}", got["openai"]);
}
