//! The GPU simulator's timing model: prefix-cache hits, eviction, queueing, batch slowdown.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use gpu_sim::{server, Gpu, SimConfig};
use tokio::time::Instant;

fn config() -> SimConfig {
    SimConfig {
        cache_tokens: 4096,
        prefill_tokens_per_sec: 1000.0,
        decode_ms_per_token: 10.0,
        batch_slowdown: 0.0,
        prefill_chunk_tokens: 0,
        max_running: 4,
        ..SimConfig::default()
    }
}

/// Runs one request; returns (time to first token, total time).
async fn request(gpu: &Gpu, prompt: &str, tokens: usize) -> (Duration, Duration) {
    let start = Instant::now();
    let mut first = None;
    gpu.run(
        prompt,
        tokens,
        |_| {},
        |_| {
            first.get_or_insert_with(|| start.elapsed());
            true
        },
    )
    .await;
    (first.unwrap_or_default(), start.elapsed())
}

fn prompt(tag: &str, chars: usize) -> String {
    let mut p = format!("{tag}: ");
    while p.len() < chars {
        p.push_str("the quick brown fox jumps over the lazy dog ");
    }
    p.truncate(chars);
    p
}

#[tokio::test(start_paused = true)]
async fn a_repeated_prefix_is_served_from_cache() {
    let gpu = Gpu::new(config());
    let p = prompt("system", 4000); // 1000 tokens: one second of prefill
    let (cold, _) = request(&gpu, &p, 1).await;
    assert_eq!(cold, Duration::from_secs(1));
    let hits_before = gpu.stats.prefix_hits.load(Ordering::Relaxed);
    // The next turn: the same prefix plus a little more.
    let (warm, _) = request(&gpu, &format!("{p} and one more question"), 1).await;
    assert!(warm < Duration::from_millis(20), "warm TTFT {warm:?}");
    let hits = gpu.stats.prefix_hits.load(Ordering::Relaxed) - hits_before;
    assert_eq!(hits, 992, "62 full blocks of 16 tokens");
    assert_eq!(
        gpu.stats.prefix_queries.load(Ordering::Relaxed),
        1000 + 1006
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_cache_evicts_the_least_recently_used_prefix() {
    let gpu = Gpu::new(SimConfig {
        cache_tokens: 1024,
        ..config()
    });
    let a = prompt("a", 2400); // 600 tokens
    let b = prompt("b", 2400);
    request(&gpu, &a, 1).await;
    request(&gpu, &b, 1).await; // 37 + 37 blocks > 64: a's 10 oldest go, its tail first
    assert_eq!(gpu.cache_usage(), 1.0);
    let hits = gpu.stats.prefix_hits.load(Ordering::Relaxed);
    let (again, _) = request(&gpu, &a, 1).await;
    // a's head still hits (27 blocks, 432 tokens); its last 168 tokens are prefilled again.
    assert_eq!(gpu.stats.prefix_hits.load(Ordering::Relaxed) - hits, 432);
    assert_eq!(again, Duration::from_millis(168));
    let (b_again, _) = request(&gpu, &b, 1).await;
    assert!(
        b_again >= Duration::from_millis(160),
        "b's tail was pushed out by a's refill: {b_again:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn requests_beyond_max_running_wait_and_prefills_queue() {
    let gpu = Arc::new(Gpu::new(SimConfig {
        max_running: 2,
        ..config()
    }));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let gpu = Arc::clone(&gpu);
        tasks.push(tokio::spawn(async move {
            request(&gpu, &prompt(&format!("p{i}"), 400), 51).await // 100 ms prefill, 500 ms decode
        }));
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(gpu.stats.running.load(Ordering::Relaxed), 2);
    assert_eq!(gpu.stats.waiting.load(Ordering::Relaxed), 2);
    let mut ttfts = Vec::new();
    for t in tasks {
        ttfts.push(t.await.unwrap().0);
    }
    // Prefills share one lane: the second waits for the first. The last two wait for a slot.
    assert_eq!(ttfts[0], Duration::from_millis(100));
    assert_eq!(ttfts[1], Duration::from_millis(200));
    assert!(ttfts[2] >= Duration::from_millis(600), "{ttfts:?}");
    assert_eq!(gpu.stats.running.load(Ordering::Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn decode_slows_with_batch_size() {
    let gpu = Arc::new(Gpu::new(SimConfig {
        batch_slowdown: 0.5,
        ..config()
    }));
    let (_, alone) = request(&gpu, "", 10).await;
    let other = {
        let gpu = Arc::clone(&gpu);
        tokio::spawn(async move { request(&gpu, "", 100).await })
    };
    tokio::task::yield_now().await;
    let (_, together) = request(&gpu, "", 10).await;
    // Ten tokens are nine decode steps apart.
    assert_eq!(alone, Duration::from_millis(90));
    assert_eq!(
        together,
        Duration::from_millis(135),
        "one other request: 1.5 × per step"
    );
    other.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_prefill_slows_the_decode_of_the_others() {
    let gpu = Arc::new(Gpu::new(SimConfig {
        prefill_chunk_tokens: 20,
        ..config()
    }));
    let (_, alone) = request(&gpu, "", 10).await;
    let streaming = {
        let gpu = Arc::clone(&gpu);
        tokio::spawn(async move { request(&gpu, "", 10).await })
    };
    tokio::task::yield_now().await;
    // 200 tokens: 200 ms of prefill, during which each 10 ms step also prefills 20 tokens.
    let (ttft, _) = request(&gpu, &prompt("cold", 800), 1).await;
    assert_eq!(ttft, Duration::from_millis(200));
    let (_, shared) = streaming.await.unwrap();
    assert_eq!(alone, Duration::from_millis(90));
    assert!(
        shared >= Duration::from_millis(90 + 6 * 20),
        "steps under the prefill take 30 ms: {shared:?}"
    );
}

/// The GPU's HTTP face on a free loopback port.
async fn serve(
    gpu: &Arc<Gpu>,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = server::router(Arc::clone(gpu), addr.to_string(), "sim".into()).unwrap();
    (
        addr,
        tokio::spawn(async move { axum::serve(listener, app).await }),
    )
}

async fn json_of(r: reqwest::RequestBuilder) -> serde_json::Value {
    r.send().await.unwrap().json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_http_face_speaks_openai_and_vllm_metrics() {
    let gpu = Arc::new(Gpu::new(SimConfig {
        speed: 100.0,
        ..config()
    }));
    let (addr, task) = serve(&gpu).await;
    let c = reqwest::Client::new();
    let url = |p: &str| format!("http://{addr}{p}");
    let body = serde_json::json!({"model": "sim", "stream": true, "max_tokens": 5,
        "messages": [{"role": "system", "content": prompt("s", 800)}, {"role": "user", "content": "hi"}]});
    let r = c
        .post(url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    assert_eq!(text.matches("chat.completion.chunk").count(), 6, "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert!(!text.contains("usage"), "usage not asked for: {text}");
    // Asked for, the usage comes as one last event before [DONE], as vLLM sends it; the
    // system prompt is cached by now.
    let mut asked = body.clone();
    asked["stream_options"] = serde_json::json!({"include_usage": true});
    let r = c.post(url("/v1/chat/completions")).json(&asked).send();
    let text = r.await.unwrap().text().await.unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let usage: serde_json::Value =
        serde_json::from_str(events[events.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(usage["choices"], serde_json::json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 5);
    assert!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 192
    );
    let plain = json_of(
        c.post(url("/v1/chat/completions"))
            .json(&serde_json::json!({"messages": body["messages"], "max_tokens": 3})),
    )
    .await;
    assert_eq!(plain["usage"]["completion_tokens"], 3);
    assert!(
        plain["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 192
    );
    let completion = json_of(
        c.post(url("/v1/completions"))
            .json(&serde_json::json!({"prompt": "once upon a time", "max_tokens": 2})),
    )
    .await;
    assert_eq!(completion["choices"][0]["text"], "tok0 tok1 ");
    let models = json_of(c.get(url("/v1/models"))).await;
    assert_eq!(models["data"][0]["id"], "sim");
    assert_eq!(c.get(url("/health")).send().await.unwrap().status(), 200);
    let metrics = c
        .get(url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // vLLM's names carry colons, which prometheus-parse does not read: these samples have no
    // labels, so `name value` lines are all there is to it.
    let value = |name: &str| -> Option<f64> {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    };
    assert_eq!(value("vllm:num_requests_running"), Some(0.0));
    assert_eq!(value("vllm:num_requests_waiting"), Some(0.0));
    assert!(value("vllm:prefix_cache_hits_total").unwrap() >= 192.0);
    assert!(
        value("vllm:prefix_cache_queries_total").unwrap()
            > value("vllm:prefix_cache_hits_total").unwrap()
    );
    assert!(value("vllm:kv_cache_usage_perc").unwrap() > 0.0);
    task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_serves_hundreds_of_concurrent_streams() {
    let gpu = Arc::new(Gpu::new(SimConfig {
        speed: 20.0,
        max_running: 600,
        ..SimConfig::default()
    }));
    let (addr, task) = serve(&gpu).await;
    let c = reqwest::Client::new();
    let sampler = {
        let gpu = Arc::clone(&gpu);
        tokio::spawn(async move {
            let mut peak = 0;
            for _ in 0..400 {
                peak = peak.max(gpu.stats.running.load(Ordering::Relaxed));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            peak
        })
    };
    let streams: Vec<_> = (0..500)
        .map(|i| {
            let c = c.clone();
            tokio::spawn(async move {
                let body = serde_json::json!({"stream": true, "max_tokens": 200,
                    "messages": [{"role": "user", "content": format!("stream {i}")}]});
                let r = c
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                r.text().await.unwrap().ends_with("data: [DONE]\n\n")
            })
        })
        .collect();
    let mut complete = 0;
    for s in streams {
        complete += usize::from(s.await.unwrap());
    }
    assert_eq!(complete, 500);
    let peak = sampler.await.unwrap();
    assert!(peak >= 300, "at most {peak} streams ran at once");
    task.abort();
}
