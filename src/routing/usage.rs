//! What an engine says it had cached of a prompt: the `usage` object of its answer, read as the
//! answer streams past. vLLM (with `--enable-prompt-tokens-details`), SGLang and llama.cpp put
//! `prompt_tokens_details.cached_tokens` in a chat or completion's usage, in a plain JSON body
//! or in the last event of a stream that asked for it (`stream_options.include_usage`); the
//! Responses API says `input_tokens_details.cached_tokens`, the Messages API
//! `cache_read_input_tokens`. llama.cpp also says it in its own `timings` (`cache_n` tokens
//! reused, `prompt_n` prefilled), in every answer, streamed or not, asked for or not. The
//! record's prediction is checked against it ([`crate::routing::Slot::report`]).
//!
//! The reader never holds the body: it looks for `"usage"` and `"timings"` in each chunk
//! (carrying a few bytes across chunk edges) and keeps only the object that follows, up to
//! [`CAPTURE_LIMIT`] bytes.

use memchr::memmem;
use serde::Deserialize;

/// The most of a usage object kept: real ones are under 400 bytes.
pub const CAPTURE_LIMIT: usize = 2048;

const NEEDLES: [&[u8]; 2] = [b"\"usage\"", b"\"timings\""];
/// The bytes carried across a chunk's edge: a needle but one.
const EDGE: usize = 8;

/// Prompt tokens and how many of them the engine found cached, as it counts tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
}

impl Usage {
    /// The share of the prompt the engine had cached, 0 to 1.
    pub fn cached_share(&self) -> f64 {
        if self.prompt_tokens == 0 {
            return 0.0;
        }
        (f64::from(self.cached_tokens) / f64::from(self.prompt_tokens)).min(1.0)
    }
}

/// Reads the last usage object with a cached-token count out of an answer, chunk by chunk.
#[derive(Debug, Default)]
pub struct UsageReader {
    /// While seeking: the last bytes seen, in case the needle is cut by a chunk's edge. While
    /// capturing: what follows the needle so far.
    buf: Vec<u8>,
    capturing: bool,
    found: Option<Usage>,
}

impl UsageReader {
    pub fn feed(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() {
            if self.capturing {
                let room = CAPTURE_LIMIT.saturating_sub(self.buf.len());
                let take = chunk.len().min(room);
                self.buf.extend_from_slice(&chunk[..take]);
                match parse(&self.buf) {
                    Parsed::More if take < chunk.len() => self.restart(),
                    Parsed::More => return,
                    Parsed::Done(usage, used) => {
                        self.found = usage.or(self.found);
                        // What came after the object is seeked again: a later usage wins.
                        let consumed = used.saturating_sub(self.buf.len() - take);
                        self.restart();
                        chunk = &chunk[consumed.min(chunk.len())..];
                        continue;
                    }
                    // Sought again from this chunk's captured part: `"usage":null` may be
                    // followed by a real one.
                    Parsed::Not => {
                        self.restart();
                        continue;
                    }
                }
                chunk = &chunk[take..];
                continue;
            }
            match self.seek(chunk) {
                Some(after) => {
                    self.capturing = true;
                    self.buf.clear();
                    chunk = &chunk[after..];
                }
                None => return,
            }
        }
    }

    /// The last usage seen that counts cached tokens.
    pub fn usage(&self) -> Option<Usage> {
        self.found
    }

    fn restart(&mut self) {
        self.capturing = false;
        self.buf.clear();
    }

    /// Where in `chunk` the first needle ends, counting one begun in the previous chunk.
    fn seek(&mut self, chunk: &[u8]) -> Option<usize> {
        let carried = self.buf.len();
        self.buf.extend_from_slice(&chunk[..chunk.len().min(EDGE)]);
        let across = (carried > 0)
            .then(|| find(&self.buf))
            .flatten()
            .map(|end| end - carried);
        if let Some(after) = across.or_else(|| find(chunk)) {
            self.buf.clear();
            return Some(after);
        }
        // Keeps the last bytes seen: this chunk's, or, of a short one, with those before it.
        if chunk.len() >= EDGE {
            self.buf.clear();
            self.buf.extend_from_slice(&chunk[chunk.len() - EDGE..]);
        } else {
            let old = self.buf.len().saturating_sub(EDGE);
            self.buf.drain(..old);
        }
        None
    }
}

/// Where the first needle in `bytes` ends.
fn find(bytes: &[u8]) -> Option<usize> {
    NEEDLES
        .iter()
        .filter_map(|n| memmem::find(bytes, n).map(|i| i + n.len()))
        .min()
}

enum Parsed {
    /// The object is not complete yet.
    More,
    /// A usage object (`None` when it counts no cached tokens) and the bytes it took.
    Done(Option<Usage>, usize),
    /// Not a usage object (`"usage": null`, or not JSON).
    Not,
}

/// Reads `: {...}` after the needle.
fn parse(after: &[u8]) -> Parsed {
    let start = after.iter().position(|b| !b.is_ascii_whitespace());
    let Some(start) = start else {
        return Parsed::More;
    };
    if after[start] != b':' {
        return Parsed::Not;
    }
    let rest = &after[start + 1..];
    let Some(open) = rest.iter().position(|b| !b.is_ascii_whitespace()) else {
        return Parsed::More;
    };
    if rest[open] != b'{' {
        return Parsed::Not;
    }
    let object = &rest[open..];
    // Parsed whole only: a number cut at its dot reads as a syntax error, not as a short body.
    let Some(end) = object_end(object) else {
        return Parsed::More;
    };
    match serde_json::from_slice::<Report>(&object[..end]) {
        Ok(report) => Parsed::Done(report.usage(), start + 1 + open + end),
        Err(_) => Parsed::Not,
    }
}

/// Where the object `bytes` opens ends (past its closing brace), once it has.
fn object_end(bytes: &[u8]) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0u32, false, false);
    for (i, &b) in bytes.iter().enumerate() {
        match (in_string, b) {
            (true, _) if escaped => escaped = false,
            (true, b'\\') => escaped = true,
            (true, b'"') => in_string = false,
            (true, _) => {}
            (false, b'"') => in_string = true,
            (false, b'{' | b'[') => depth += 1,
            (false, b'}' | b']') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            (false, _) => {}
        }
    }
    None
}

/// The fields of a usage object, as the APIs name them.
#[derive(Deserialize)]
struct Report {
    prompt_tokens: Option<u64>,
    input_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens_details: Option<Details>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    /// llama.cpp's `timings`.
    cache_n: Option<u64>,
    prompt_n: Option<u64>,
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

impl Report {
    fn usage(&self) -> Option<Usage> {
        let details = self
            .prompt_tokens_details
            .as_ref()
            .or(self.input_tokens_details.as_ref())
            .and_then(|d| d.cached_tokens);
        let (prompt, cached) = match (details, self.cache_read_input_tokens) {
            _ if self.cache_n.is_some() => {
                let cached = self.cache_n?;
                (cached.saturating_add(self.prompt_n?), cached)
            }
            (Some(cached), _) => (self.prompt_tokens.or(self.input_tokens)?, cached),
            // The Messages API counts cached tokens apart from its `input_tokens`.
            (None, Some(read)) => {
                let written = self.cache_creation_input_tokens.unwrap_or(0);
                (
                    self.input_tokens?
                        .saturating_add(read)
                        .saturating_add(written),
                    read,
                )
            }
            (None, None) => return None,
        };
        let clamp = |n: u64| n.min(u64::from(u32::MAX)) as u32;
        Some(Usage {
            prompt_tokens: clamp(prompt),
            cached_tokens: clamp(cached.min(prompt)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(chunks: &[&str]) -> Option<Usage> {
        let mut r = UsageReader::default();
        for c in chunks {
            r.feed(c.as_bytes());
        }
        r.usage()
    }

    const VLLM_STREAM: &str = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":1540,",
        "\"total_tokens\":1550,\"completion_tokens\":10,",
        "\"prompt_tokens_details\":{\"cached_tokens\":1536}}}\n\n",
        "data: [DONE]\n\n"
    );

    #[test]
    fn a_stream_gives_its_last_usage_however_it_is_cut() {
        let want = Some(Usage {
            prompt_tokens: 1540,
            cached_tokens: 1536,
        });
        assert_eq!(read(&[VLLM_STREAM]), want);
        for cut in 1..VLLM_STREAM.len() {
            let (a, b) = VLLM_STREAM.split_at(cut);
            assert_eq!(read(&[a, b]), want, "cut at {cut}");
        }
        let bytes: Vec<String> = VLLM_STREAM.chars().map(String::from).collect();
        let each: Vec<&str> = bytes.iter().map(String::as_str).collect();
        assert_eq!(read(&each), want, "a byte at a time");
    }

    #[test]
    fn llama_cpp_says_it_in_its_timings() {
        let last = r#"data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"object":"chat.completion.chunk","timings":{"cache_n":1536,"prompt_n":4,"prompt_ms":26.6}}

data: [DONE]

"#;
        let want = Some(Usage {
            prompt_tokens: 1540,
            cached_tokens: 1536,
        });
        for cut in 1..last.len() {
            let (a, b) = last.split_at(cut);
            assert_eq!(read(&[a, b]), want, "cut at {cut}");
        }
    }

    #[test]
    fn the_apis_name_their_counts_differently() {
        let json = r#"{"id":"x","choices":[{"text":"a"}],"usage" : { "prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}}}"#;
        assert_eq!(
            read(&[json]),
            Some(Usage {
                prompt_tokens: 10,
                cached_tokens: 0
            })
        );
        let responses = r#"event: response.completed
data: {"type":"response.completed","response":{"id":"resp_1","usage":{"input_tokens":300,"input_tokens_details":{"cached_tokens":256},"output_tokens":5}}}"#;
        assert_eq!(
            read(&[responses]),
            Some(Usage {
                prompt_tokens: 300,
                cached_tokens: 256
            })
        );
        let messages = r#"{"type":"message","usage":{"input_tokens":20,"cache_read_input_tokens":200,"cache_creation_input_tokens":0,"output_tokens":3}}"#;
        assert_eq!(
            read(&[messages]),
            Some(Usage {
                prompt_tokens: 220,
                cached_tokens: 200
            })
        );
    }

    #[test]
    fn counts_past_what_adds_up_are_held_at_the_top() {
        // An engine's counts are read as they come: sums that pass u64 saturate.
        let top = u64::MAX;
        let llama = format!(r#"{{"timings":{{"cache_n":{top},"prompt_n":1}}}}"#);
        let messages = format!(
            r#"{{"usage":{{"input_tokens":{top},"cache_read_input_tokens":1,"cache_creation_input_tokens":{top}}}}}"#
        );
        let at_top = |cached_tokens| {
            Some(Usage {
                prompt_tokens: u32::MAX,
                cached_tokens,
            })
        };
        assert_eq!(read(&[llama.as_str()]), at_top(u32::MAX));
        assert_eq!(read(&[messages.as_str()]), at_top(1));
    }

    #[test]
    fn usage_without_a_cached_count_or_in_the_text_says_nothing() {
        // vLLM without --enable-prompt-tokens-details.
        let plain = r#"{"usage":{"prompt_tokens":10,"prompt_tokens_details":null}}"#;
        assert_eq!(read(&[plain]), None);
        // Quoted in an answer, the name is escaped.
        let quoted = r#"data: {"choices":[{"delta":{"content":"\"usage\": {\"prompt_tokens\": 5, \"prompt_tokens_details\": {\"cached_tokens\": 5}}"}}]}"#;
        assert_eq!(read(&[quoted]), None);
        // An object too long to be a usage is dropped, and the reader goes on.
        let long = format!(
            r#"{{"usage":{{"x":"{}"}}, "usage":{{"prompt_tokens":4,"prompt_tokens_details":{{"cached_tokens":2}}}}}}"#,
            "y".repeat(CAPTURE_LIMIT)
        );
        assert_eq!(
            read(&[&long]),
            Some(Usage {
                prompt_tokens: 4,
                cached_tokens: 2
            })
        );
    }

    #[test]
    fn the_cached_share_is_bounded() {
        let u = Usage {
            prompt_tokens: 0,
            cached_tokens: 0,
        };
        assert_eq!(u.cached_share(), 0.0);
        let u = Usage {
            prompt_tokens: 100,
            cached_tokens: 75,
        };
        assert_eq!(u.cached_share(), 0.75);
    }
}
