//! A streamed OpenAI answer as the client reads it: when its first event came, its text, the
//! prompt tokens the engine says it had cached, and how the stream ended.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

#[derive(Debug, Default)]
pub struct Reply {
    /// From the request's start to the first event.
    pub ttft: Duration,
    pub events: usize,
    pub text: String,
    /// The prompt's tokens, cached and not.
    pub prompt: u64,
    /// Those the engine found in its KV cache.
    pub cached: u64,
    /// The engine's own time for the rest of the prompt (`timings.prompt_ms`).
    pub prefill_ms: f64,
    /// Whether `data: [DONE]` came.
    pub done: bool,
    /// How the body failed, if it did: the error event that ended the stream, or else the
    /// transport's error.
    pub error: Option<String>,
}

impl Reply {
    fn event(&mut self, data: &str) {
        if data == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(event) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(error) = event.get("error") {
            self.error = Some(error.to_string());
        }
        for choice in event["choices"].as_array().into_iter().flatten() {
            let delta = choice["delta"]["content"].as_str();
            self.text += delta.or(choice["text"].as_str()).unwrap_or_default();
        }
        // llama.cpp says it twice in its last events: in its own `timings` (the tokens it
        // prefilled and those it reused) and in OpenAI's `usage`.
        let timings = &event["timings"];
        if let (Some(cached), Some(prefilled)) =
            (timings["cache_n"].as_u64(), timings["prompt_n"].as_u64())
        {
            self.cached = cached;
            self.prompt = cached + prefilled;
            self.prefill_ms = timings["prompt_ms"].as_f64().unwrap_or_default();
        } else if let Some(prompt) = event["usage"]["prompt_tokens"].as_u64() {
            self.prompt = prompt;
            let cached = &event["usage"]["prompt_tokens_details"]["cached_tokens"];
            self.cached = cached.as_u64().unwrap_or_default();
        }
    }
}

/// Sends `body` to `url` and returns once the response head is in.
pub async fn post(url: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(url)
        .json(body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap()
}

/// Reads the stream of a request sent at `start` to its end.
pub async fn read(response: reqwest::Response, start: Instant) -> Reply {
    read_with(response, start, usize::MAX, || {}).await
}

/// [`read`], calling `after` once `n` events are in.
pub async fn read_with(
    response: reqwest::Response,
    start: Instant,
    n: usize,
    after: impl FnOnce(),
) -> Reply {
    assert_eq!(response.status(), 200, "{:?}", response.headers());
    let mut reply = Reply::default();
    let mut after = Some(after);
    // Bytes: a chunk may end inside a character.
    let mut pending = Vec::new();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) => {
                // An error event, when one came, says more than the cut that follows it.
                reply.error.get_or_insert(format!("{e:?}"));
                break;
            }
        };
        pending.extend_from_slice(&chunk);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            let Some(data) = event.trim().strip_prefix("data:") else {
                continue;
            };
            if reply.events == 0 {
                reply.ttft = start.elapsed();
            }
            reply.events += 1;
            reply.event(data.trim());
            if reply.events >= n {
                if let Some(after) = after.take() {
                    after();
                }
            }
        }
    }
    reply
}
