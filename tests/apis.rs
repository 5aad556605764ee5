//! The APIs real clients use beyond chat and completions, through the real proxy binary to
//! mock engines on loopback: OpenAI's Responses API (a follow-up naming a stored response
//! goes to the engine that made it) and Anthropic's Messages API (keyed like chat).

mod common;

use std::collections::HashSet;

use common::*;

const RESPONSES: &str = "/v1/responses";
const MESSAGES: &str = "/v1/messages";

async fn post(c: &reqwest::Client, url: String, body: String) -> reqwest::Response {
    c.post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap()
}

/// Whether a test that spreads conversations over two engines has opened enough of them: at
/// least `at_least`, and more until both engines have been home to one, at most 64. The
/// engines' ports, random, place the keys on the ring, so a fixed number alone sometimes opens
/// every conversation on one engine.
fn opened_enough(opened: usize, at_least: usize, homes: &HashSet<String>) -> bool {
    opened >= 64 || (opened >= at_least && homes.len() == 2)
}

fn upstream_of(r: &reqwest::Response) -> String {
    r.headers()["x-upstream"].to_str().unwrap().to_owned()
}

/// `r` if it answered 200; otherwise a failure that shows what came back instead.
async fn ok(r: reqwest::Response, what: &str) -> reqwest::Response {
    if r.status() != 200 {
        let (status, headers) = (r.status(), format!("{:?}", r.headers()));
        panic!(
            "{what}: {status} {headers} {}",
            r.text().await.unwrap_or_default()
        );
    }
    r
}

/// A response's id: the JSON body's `id`, or a stream's first `response.id`.
async fn response_id(r: reqwest::Response) -> String {
    let text = r.text().await.unwrap();
    let json = match text.strip_prefix("event:") {
        None => text.as_str(),
        Some(_) => text
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .expect("a data line"),
    };
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    v["id"]
        .as_str()
        .or(v["response"]["id"].as_str())
        .unwrap()
        .to_owned()
}

/// A Responses request; fields in the order the official SDK sends them (`input` first).
fn create(input: &str, previous: Option<&str>, stream: bool) -> String {
    let mut body = serde_json::json!({"input": input, "model": "m", "stream": stream});
    if let Some(id) = previous {
        body["previous_response_id"] = id.into();
    }
    body.to_string()
}

/// Each conversation's follow-ups name its latest response, with inputs whose keys differ:
/// only the learned id can bring them back to its engine, which alone holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_follow_ups_reach_the_engine_that_made_the_response() {
    let ups = upstreams::<2>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    // The mock holds only its own responses, as vLLM does.
    let direct = post(
        &c,
        format!("http://{}{RESPONSES}", ups[1].addr),
        create("x", Some("resp_a_0"), false),
    )
    .await;
    assert_eq!(direct.status(), 404);
    let mut homes = HashSet::new();
    // Eight alone all opened on one engine about once in 128 runs.
    let mut conv = 0;
    while !opened_enough(conv, 8, &homes) {
        let stream = conv % 2 == 1;
        let r = post(
            &c,
            proxy.url(RESPONSES),
            create(&format!("conversation {conv}"), None, stream),
        )
        .await;
        let r = ok(r, &format!("conversation {conv} opening")).await;
        let home = upstream_of(&r);
        homes.insert(home.clone());
        let mut id = response_id(r).await;
        for turn in 1..=4 {
            let input = format!("conversation {conv}, turn {turn}");
            let r = post(&c, proxy.url(RESPONSES), create(&input, Some(&id), stream)).await;
            let r = ok(r, &format!("conversation {conv} turn {turn} lost {id}")).await;
            assert_eq!(upstream_of(&r), home, "conversation {conv} turn {turn}");
            id = response_id(r).await;
            assert!(id.starts_with(&format!("resp_{home}_")), "{id}");
        }
        conv += 1;
    }
    assert_eq!(homes.len(), 2, "the conversations all opened on {homes:?}");
    let metrics = proxy.metrics().await;
    assert!(metrics.contains("route=\"affinity\""), "{metrics}");
    assert!(metrics.contains("source=\"responses\""), "{metrics}");
    // An id prefixlb never forwarded goes where its key says, and an engine without it
    // answers 404 as it would directly.
    let unknown = post(
        &c,
        proxy.url(RESPONSES),
        create("x", Some("resp_elsewhere_1"), false),
    )
    .await;
    assert_eq!(unknown.status(), 404);
    proxy.assert_idle().await;
}

/// A follow-up whose engine is down is routed by its key like any other request: the engine
/// that gets it answers 404 for the response it never held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_follow_up_whose_engine_is_gone_gets_the_engines_404() {
    let ups = upstreams::<2>().await;
    let config = TestConfig::new()
        .peers(&ups)
        .health_check_interval_ms(50)
        .unhealthy_after(1);
    let proxy = start_proxy(&config).await;
    let c = client();
    let r = post(&c, proxy.url(RESPONSES), create("q", None, false)).await;
    let home = upstream_of(&r);
    let id = response_id(r).await;
    let gone = ups.iter().find(|u| u.name == home).unwrap();
    gone.healthy
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let r = post(&c, proxy.url(RESPONSES), create("more", Some(&id), false)).await;
        if upstream_of(&r) != home {
            assert_eq!(r.status(), 404);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "still sent to {home}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// An Anthropic conversation of `turns` user turns, `system` before `messages`.
fn anthropic(system: &str, first: &str, turns: usize) -> String {
    let mut messages = vec![serde_json::json!({"role": "user", "content": first})];
    for t in 1..turns {
        messages.push(serde_json::json!({"role": "assistant", "content": [{"type": "text", "text": format!("answer {t}")}]}));
        messages.push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
    }
    let system = serde_json::Value::from(system);
    let messages = serde_json::Value::from(messages);
    format!(r#"{{"model":"m","max_tokens":64,"system":{system},"messages":{messages}}}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_conversations_keep_their_peer_and_spread_by_key() {
    let ups = upstreams::<2>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let c = client();
    let mut homes = HashSet::new();
    // Twelve alone all opened on one engine about once in 2,048 runs.
    let mut conv = 0;
    while !opened_enough(conv, 12, &homes) {
        let system = format!("You answer for desk {conv}. ").repeat(20);
        let mut seen = HashSet::new();
        for turn in 1..=4 {
            let body = anthropic(&system, &format!("ticket {conv}"), turn);
            let r = post(&c, proxy.url(MESSAGES), body).await;
            assert_eq!(r.status(), 200);
            seen.insert(upstream_of(&r));
        }
        assert_eq!(seen.len(), 1, "conversation {conv} moved: {seen:?}");
        homes.extend(seen);
        conv += 1;
    }
    assert_eq!(homes.len(), 2, "{conv} conversations all went to {homes:?}");
    let keyed = format!(
        "prefixlb_key_source_total{{source=\"messages\"}} {}",
        conv * 4
    );
    assert!(proxy.metrics().await.contains(&keyed), "{keyed}");
}
