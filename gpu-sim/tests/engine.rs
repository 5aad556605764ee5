//! The engine model over real HTTP on loopback: chunked prefill sharing steps with decodes,
//! KV memory forcing preemption, a half-pace GPU, and SGLang's load endpoint.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_sim::{server, Gpu, Model, SimConfig};
use serde_json::{json, Value};

fn config() -> SimConfig {
    SimConfig {
        prefill_tokens_per_sec: 10_000.0,
        decode_ms_per_token: 10.0,
        batch_slowdown: 0.0,
        max_batched_tokens: 512,
        request_overhead_ms: 0.0,
        ..SimConfig::engine()
    }
}

/// A prompt of `tokens` tokens at the engine's 3.3 characters a token, unique to `tag`.
fn prompt(tag: &str, tokens: usize) -> String {
    let chars = (tokens as f64 * 3.3) as usize;
    let mut p = format!("{tag}: ");
    while p.len() < chars {
        p.push_str("the quick brown fox jumps over the lazy dog ");
    }
    p.truncate(chars);
    p
}

async fn serve(gpu: Gpu) -> (String, Arc<Gpu>) {
    let gpu = Arc::new(gpu);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = server::router(Arc::clone(&gpu), addr.to_string(), "sim".into()).unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), gpu)
}

/// Streams a completion; returns when each token arrived, from the request's start.
async fn stream(base: &str, prompt: &str, max_tokens: usize) -> Vec<Duration> {
    let start = Instant::now();
    let mut r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut times = Vec::new();
    while let Some(bytes) = r.chunk().await.unwrap() {
        let text = String::from_utf8_lossy(&bytes);
        for _ in 0..text.matches("\"text\":\"tok").count() {
            times.push(start.elapsed());
        }
    }
    times
}

async fn get(base: &str, path: &str) -> String {
    reqwest::get(format!("{base}{path}"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_prefill_slows_the_running_decodes() {
    // A step of one decode takes 10 + 10 ms; with a 512-token chunk beside it, 71.2 ms
    // (halved by `speed`).
    let (base, _gpu) = serve(Gpu::new(SimConfig {
        speed: 2.0,
        batch_slowdown: 1.0,
        ..config()
    }))
    .await;
    let streaming = {
        let base = base.clone();
        tokio::spawn(async move { stream(&base, "a short chat", 80).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // 4096 tokens: eight steps of 512 prompt tokens each, beside the stream's decode.
    let long = stream(&base, &prompt("long", 4096), 1).await;
    let times = streaming.await.unwrap();
    assert_eq!(times.len(), 80);
    let mut gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    let alone = {
        let mut first: Vec<Duration> = gaps[..10].to_vec();
        first.sort();
        first[5]
    };
    gaps.sort();
    // 35.6 ms against 10 ms: 3.56 ×.
    let slow = gaps.iter().filter(|g| **g >= alone * 5 / 2).count();
    assert!(
        slow >= 6,
        "eight steps carry a chunk: {slow} gaps ≥ 2.5 × {alone:?}, gaps {gaps:?}"
    );
    // The prefill is slowed too: eight steps of 35.6 ms, not the 30.6 ms of a prefill alone.
    assert!(long[0] >= Duration::from_millis(270), "TTFT {:?}", long[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_kv_memory_preempts_the_newest_request() {
    // 64 blocks of 16 tokens: two prompts of 400 tokens (25 blocks each) fit, but not once
    // each has generated ~112 tokens more.
    let (base, _) = serve(Gpu::new(SimConfig {
        cache_tokens: 1024,
        speed: 10.0,
        ..config()
    }))
    .await;
    let a = {
        let base = base.clone();
        tokio::spawn(async move { stream(&base, &prompt("a", 400), 300).await })
    };
    tokio::time::sleep(Duration::from_millis(5)).await;
    let b = stream(&base, &prompt("b", 400), 300).await;
    let a = a.await.unwrap();
    assert_eq!((a.len(), b.len()), (300, 300), "both finish every token");
    let metrics = get(&base, "/metrics").await;
    assert!(
        metric(&metrics, "vllm:num_preemptions_total") >= 1.0,
        "{metrics}"
    );
    // b was preempted, so it finished after a although both run at the same pace.
    assert!(b.last() > a.last(), "a {:?}, b {:?}", a.last(), b.last());
    // Each time b is readmitted, a's growth pushes b's idle cached prompt blocks out.
    assert!(
        metric(&metrics, "gpu_sim:prefix_cache_evictions_total") >= 1.0,
        "{metrics}"
    );
    // Hits are counted on a request's first admission only, as a router's view of them.
    assert_eq!(metric(&metrics, "vllm:prefix_cache_queries_total"), 800.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_pace_gpu_takes_twice_as_long() {
    let (full, _) = serve(Gpu::new(config())).await;
    let (half, _) = serve(Gpu::new(SimConfig {
        pace: 0.5,
        ..config()
    }))
    .await;
    // 4000 prompt tokens (eight steps of 10 ms and up to 51.2 ms) and nine decode steps of
    // 10 ms: 0.57 s.
    let p = prompt("same", 4000);
    let (a, b) = tokio::join!(stream(&full, &p, 10), stream(&half, &p, 10));
    let (a, b) = (a[9].as_secs_f64(), b[9].as_secs_f64());
    assert!(a > 0.55 && a < 1.0, "full pace took {a} s");
    let ratio = b / a;
    assert!(
        (1.85..2.15).contains(&ratio),
        "half pace took {ratio} × as long"
    );
}

/// What SGLang's `/v1/loads` says of the one rank.
async fn load(base: &str) -> Value {
    let body: Value = serde_json::from_str(&get(base, "/v1/loads").await).unwrap();
    assert_eq!(body["dp_rank_count"], 1);
    body["loads"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_loads_reports_what_is_in_flight_in_both_models() {
    for model_config in [SimConfig::default(), config()] {
        let model = model_config.model;
        let (base, _) = serve(Gpu::new(SimConfig {
            max_running: 2,
            speed: 2.0,
            ..model_config
        }))
        .await;
        let idle = load(&base).await;
        assert_eq!(
            (
                idle["num_running_reqs"].as_i64(),
                idle["num_waiting_reqs"].as_i64()
            ),
            (Some(0), Some(0))
        );
        let streams: Vec<_> = (0..4)
            .map(|i| {
                let base = base.clone();
                tokio::spawn(async move { stream(&base, &prompt(&format!("p{i}"), 200), 60).await })
            })
            .collect();
        let mut busy = load(&base).await;
        for _ in 0..100 {
            // All four have arrived, and the scheduler has admitted what it can.
            if busy["num_total_reqs"] == 4
                && busy["num_running_reqs"] == 2
                && busy["token_usage"].as_f64() > Some(0.0)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
            busy = load(&base).await;
        }
        assert_eq!(busy["num_running_reqs"], 2, "{model:?}: {busy}");
        assert_eq!(busy["num_waiting_reqs"], 2, "{model:?}: {busy}");
        assert_eq!(busy["num_total_reqs"], 4);
        assert_eq!(busy["max_total_num_tokens"], 65_536);
        assert!(busy["token_usage"].as_f64().unwrap() > 0.0, "{busy}");
        if model == Model::Engine {
            // Two running requests hold at least their prompts' blocks.
            assert!(
                busy["num_used_tokens"].as_u64().unwrap() >= 2 * 192,
                "{busy}"
            );
        }
        let legacy: Value = serde_json::from_str(&get(&base, "/get_load").await).unwrap();
        assert_eq!(legacy[0]["num_reqs"], 4, "{legacy}");
        let info: Value = serde_json::from_str(&get(&base, "/server_info").await).unwrap();
        assert_eq!(info["max_running_requests"], 2, "{info}");
        for s in streams {
            assert_eq!(s.await.unwrap().len(), 60);
        }
        let done = load(&base).await;
        assert_eq!(
            (
                done["num_running_reqs"].as_i64(),
                done["num_waiting_reqs"].as_i64()
            ),
            (Some(0), Some(0)),
            "{model:?}"
        );
    }
}
