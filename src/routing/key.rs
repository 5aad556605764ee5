//! The routing key: what of a request must be equal for two requests to share a KV cache.
//!
//! Sources, first that applies wins: a session header; the stable prefix of an OpenAI chat,
//! completions, Responses, Anthropic Messages or SGLang generate body; a fallback (the client
//! address, or nothing, which spreads by load). A session header names the key's point on the
//! ring, but the body of a prompt route is read all the same: what each peer holds of the
//! prompt is what its engine's cache can reuse, and a new session on a long shared document
//! must find where that went. The body may be a prefix cut anywhere, even mid-string or
//! mid-codepoint: jiter's pull parser walks it with partial strings allowed, stops as soon as
//! the key is complete, and tells a cut body (ask for more bytes) from a malformed one (fall
//! back). The prompt's blocks are named over the body's bytes from the prompt on
//! ([`super::blocks`]): a complete key asks for more of the body only to name more of them.
//!
//! The chat key is every message up to and including the first `user` message, plus `model`
//! when it comes before `messages`. History grows at the end, so every turn of one
//! conversation yields the same key, while two conversations that share only a system prompt
//! differ in their first user message. A `model` after the prompt is left out on purpose:
//! reaching it means reading the whole history, which a long turn cut at the peek limit
//! cannot, and a key must not change between a short turn and a long one.
//!
//! Anthropic Messages and OpenAI Responses bodies key the same way: their `messages` (or
//! `input`, a string standing for one user message) up to the first user message, after the
//! `system` (or `instructions`) when it comes before them, for the reason `model` does.

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, Method};
use jiter::{Jiter, JiterError, JiterErrorType, JsonErrorType};

use super::blocks::{Blocks, Turn};
use super::hash::KeyEncoder;
use super::policy::decision::Demand;
use super::prompt::{is_cut, scan, PromptField, Span};
pub use super::source::{FallbackReason, KeySource};
use super::tuning::Tuning;

pub const DEFAULT_SESSION_HEADER: &str = "x-session-id";
pub const DEFAULT_PREFIX_CHARS: usize = 2048;

/// Where a request's key comes from when its headers and body give none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fallback {
    /// Requests from one client address share a key.
    ClientAddr,
    /// No key: the request is spread by load.
    None,
}

#[derive(Debug, Clone)]
pub struct KeyConfig {
    /// `None` disables the session header source.
    pub session_header: Option<HeaderName>,
    /// Request paths (without query) whose POST bodies carry a key; `None` disables a source.
    pub chat_path: Option<String>,
    pub completions_path: Option<String>,
    pub generate_path: Option<String>,
    pub messages_path: Option<String>,
    pub responses_path: Option<String>,
    /// How much of a completions `prompt` (or generate `text`) is the key, in characters.
    pub prefix_chars: usize,
    pub fallback: Fallback,
}

impl Default for KeyConfig {
    fn default() -> Self {
        Self {
            session_header: Some(HeaderName::from_static(DEFAULT_SESSION_HEADER)),
            chat_path: Some("/v1/chat/completions".into()),
            completions_path: Some("/v1/completions".into()),
            generate_path: Some("/generate".into()),
            messages_path: Some("/v1/messages".into()),
            responses_path: Some("/v1/responses".into()),
            prefix_chars: DEFAULT_PREFIX_CHARS,
            fallback: Fallback::ClientAddr,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingKey {
    /// The point on the ring; `None` spreads the request by load.
    pub hash: Option<u64>,
    pub source: KeySource,
    pub fallback: Option<FallbackReason>,
    /// The prompt's block chain, as far as it was read: where its prefixes went is how much
    /// of it each peer holds.
    pub blocks: Blocks,
}

/// How much more of the body may follow the bytes given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyEnd {
    /// More bytes may come: a cut key asks for them.
    More,
    /// The body is complete.
    Complete,
    /// More bytes exist but will not be read: a cut key is used as far as it goes.
    Limit,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extract {
    Key(RoutingKey),
    /// The key is complete, and more of the body would name more of the prompt's blocks.
    Deeper(RoutingKey),
    NeedMore,
}

/// The body formats that carry a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    Chat,
    Completions,
    Generate,
    /// The Anthropic Messages API.
    Messages,
    /// The OpenAI Responses API.
    Responses,
}

impl BodyKind {
    fn source(self) -> KeySource {
        match self {
            BodyKind::Chat => KeySource::Chat,
            BodyKind::Completions => KeySource::Completions,
            BodyKind::Generate => KeySource::Generate,
            BodyKind::Messages => KeySource::Messages,
            BodyKind::Responses => KeySource::Responses,
        }
    }

    /// Whether the prompt is a conversation, whose opening is its key.
    fn is_conversation(self) -> bool {
        matches!(
            self,
            BodyKind::Chat | BodyKind::Messages | BodyKind::Responses
        )
    }
}

/// One request as the key extractor sees it.
#[derive(Debug, Clone, Copy)]
pub struct RequestParts<'a> {
    pub method: &'a Method,
    pub path: &'a str,
    pub headers: &'a HeaderMap,
    pub client: Option<IpAddr>,
    pub body: &'a [u8],
    pub end: BodyEnd,
}

#[derive(Debug, Clone)]
pub struct KeyExtractor {
    config: KeyConfig,
    /// Characters of text per token, for the prompt's tokens estimated from its bytes.
    chars_per_token: usize,
}

impl Default for KeyExtractor {
    fn default() -> Self {
        Self::new(KeyConfig::default())
    }
}

impl KeyExtractor {
    /// An extractor with the default tuning's token estimate.
    pub fn new(config: KeyConfig) -> Self {
        let chars_per_token = Tuning::DEFAULT.chars_per_token as usize;
        Self {
            config,
            chars_per_token,
        }
    }

    /// The same extractor, estimating tokens by `tuning`'s characters per token.
    pub fn tuned(self, tuning: &Tuning) -> Self {
        Self {
            chars_per_token: tuning.chars_per_token.max(1) as usize,
            ..self
        }
    }

    /// What a request with `key` and a body `body_bytes` long asks of the cluster.
    pub fn demand(&self, key: &RoutingKey, body_bytes: usize) -> Demand {
        let tokens = (body_bytes / self.chars_per_token).min(u32::MAX as usize) as u32;
        Demand {
            hash: key.hash,
            prompt_tokens: tokens,
            blocks: key.blocks,
            model: None,
            session: key.source == KeySource::SessionHeader,
        }
    }

    /// The body format of a request to a prompt route, or `None` when its body carries no
    /// prompt.
    pub fn body_kind(&self, method: &Method, path: &str) -> Option<BodyKind> {
        if *method != Method::POST {
            return None;
        }
        let is = |p: &Option<String>| p.as_deref() == Some(path);
        if is(&self.config.chat_path) {
            Some(BodyKind::Chat)
        } else if is(&self.config.completions_path) {
            Some(BodyKind::Completions)
        } else if is(&self.config.generate_path) {
            Some(BodyKind::Generate)
        } else if is(&self.config.messages_path) {
            Some(BodyKind::Messages)
        } else if is(&self.config.responses_path) {
            Some(BodyKind::Responses)
        } else {
            None
        }
    }

    /// Whether a request creates a Responses API response, which may name the one before it.
    pub fn is_responses(&self, method: &Method, path: &str) -> bool {
        *method == Method::POST && self.config.responses_path.as_deref() == Some(path)
    }

    /// The key of a request whose body is not read: its session header, or the fallback.
    pub fn key_without_body(&self, headers: &HeaderMap, client: Option<IpAddr>) -> RoutingKey {
        self.key_without_prompt(headers, client, FallbackReason::NoKeySource)
    }

    /// The key of a request whose body gave no prompt, for `reason`: its session header, or
    /// the fallback.
    pub fn key_without_prompt(
        &self,
        headers: &HeaderMap,
        client: Option<IpAddr>,
        reason: FallbackReason,
    ) -> RoutingKey {
        self.session_key(headers)
            .unwrap_or_else(|| self.fallback(client, reason))
    }

    /// Whether the request names its session in a header.
    pub fn has_session(&self, headers: &HeaderMap) -> bool {
        self.session_key(headers).is_some()
    }

    pub fn key_for(&self, req: &RequestParts<'_>) -> Extract {
        let Some(kind) = self.body_kind(req.method, req.path) else {
            return Extract::Key(self.key_without_body(req.headers, req.client));
        };
        match self.body_key(kind, req.body, req.end) {
            Ok((hash, blocks, whole)) => {
                // A session keeps its point on the ring; the prompt's blocks price it.
                let key = match self.session_key(req.headers) {
                    Some(session) => RoutingKey { blocks, ..session },
                    None => RoutingKey {
                        hash: Some(hash),
                        source: kind.source(),
                        fallback: None,
                        blocks,
                    },
                };
                if whole {
                    Extract::Key(key)
                } else {
                    Extract::Deeper(key)
                }
            }
            Err(Cut::NeedMore) => Extract::NeedMore,
            Err(Cut::Fallback(reason)) => {
                Extract::Key(self.key_without_prompt(req.headers, req.client, reason))
            }
        }
    }

    fn session_key(&self, headers: &HeaderMap) -> Option<RoutingKey> {
        let value = headers.get(self.config.session_header.as_ref()?)?;
        if value.is_empty() {
            return None;
        }
        let mut enc = KeyEncoder::default();
        enc.part(b'S', value.as_bytes());
        let hash = enc.finish();
        Some(RoutingKey {
            hash: Some(hash),
            source: KeySource::SessionHeader,
            fallback: None,
            blocks: Blocks::of_key(hash),
        })
    }

    fn fallback(&self, client: Option<IpAddr>, reason: FallbackReason) -> RoutingKey {
        let hash = match (self.config.fallback, client) {
            (Fallback::ClientAddr, Some(ip)) => {
                let mut enc = KeyEncoder::default();
                match ip {
                    IpAddr::V4(v4) => enc.part(b'4', &v4.octets()),
                    IpAddr::V6(v6) => enc.part(b'6', &v6.octets()),
                }
                Some(enc.finish())
            }
            _ => None,
        };
        RoutingKey {
            hash,
            source: if hash.is_some() {
                KeySource::ClientAddr
            } else {
                KeySource::None
            },
            fallback: Some(reason),
            blocks: hash.map(Blocks::of_key).unwrap_or_default(),
        }
    }

    fn body_key(
        &self,
        kind: BodyKind,
        body: &[u8],
        end: BodyEnd,
    ) -> Result<(u64, Blocks, bool), Cut> {
        if body.iter().all(u8::is_ascii_whitespace) {
            return Err(match end {
                BodyEnd::More => Cut::NeedMore,
                BodyEnd::Complete => Cut::Fallback(FallbackReason::EmptyBody),
                BodyEnd::Limit => Cut::Fallback(FallbackReason::PeekLimit),
            });
        }
        let mut enc = KeyEncoder::default();
        let mut span = Span::default();
        let field = match kind {
            BodyKind::Chat => PromptField::Messages,
            BodyKind::Messages => PromptField::AnthropicMessages,
            BodyKind::Responses => PromptField::ResponsesInput,
            BodyKind::Completions => PromptField::Text("prompt", self.config.prefix_chars),
            BodyKind::Generate => PromptField::Text("text", self.config.prefix_chars),
        };
        let scan = scan(body, &mut enc, field, &mut span);
        let done = |enc: &KeyEncoder, whole: bool| {
            let model = span.model.map(|(from, to)| &body[from..to]);
            let blocks = span.start.map_or_else(Blocks::default, |start| {
                let key_end = span.key_end.unwrap_or(body.len());
                let blocks = Blocks::of_prompt(body, model, start, key_end);
                // The messages end with the key's first user message.
                let after_key = body[key_end..].iter().find(|b| !b.is_ascii_whitespace());
                match (kind.is_conversation(), after_key) {
                    (false, _) => blocks,
                    (true, Some(b']')) => blocks.turn(Turn::Opening),
                    (true, _) => blocks.turn(Turn::Later),
                }
            });
            (enc.finish(), blocks, whole)
        };
        match scan {
            // More of the body would only name more of the prompt's blocks.
            Ok(true) => Ok(done(&enc, end != BodyEnd::More)),
            Ok(false) => Err(Cut::Fallback(FallbackReason::NoPrompt)),
            // Which error the parser meets first in a broken body can change as more of it
            // arrives (a bad byte early on, or a cut escape later), and a body that falls back
            // on one prefix must not wait for more on a longer one: a broken body is judged
            // once, when it has all arrived or the window is full.
            Err(_) if end == BodyEnd::More => Err(Cut::NeedMore),
            Err(e) if is_cut(&e, body.len()) => match end {
                BodyEnd::Limit if !enc.is_empty() => Ok(done(&enc, true)),
                BodyEnd::Limit => Err(Cut::Fallback(FallbackReason::PeekLimit)),
                // A body that has all arrived and breaks off.
                BodyEnd::Complete | BodyEnd::More => {
                    Err(Cut::Fallback(FallbackReason::InvalidJson))
                }
            },
            Err(e) => Err(reason_of(&e, body, end)),
        }
    }
}

enum Cut {
    NeedMore,
    Fallback(FallbackReason),
}

/// Why a body that has all arrived (or filled the window) falls back. A value of the wrong type
/// is told from malformed JSON by reading it to its end; cut by the window, it is taken as
/// what its first byte says.
fn reason_of(e: &JiterError, body: &[u8], end: BodyEnd) -> Cut {
    let reason = match &e.error_type {
        // jiter types a value by its first byte, so `nonsense` reads as a malformed null.
        JiterErrorType::WrongType { .. } => match Jiter::new(body).next_skip() {
            Ok(_) => FallbackReason::WrongShape,
            Err(skip) if is_cut(&skip, body.len()) && end == BodyEnd::Limit => {
                FallbackReason::WrongShape
            }
            Err(_) => FallbackReason::InvalidJson,
        },
        JiterErrorType::JsonError(JsonErrorType::RecursionLimitExceeded) => FallbackReason::TooDeep,
        JiterErrorType::JsonError(JsonErrorType::InvalidUnicodeCodePoint) => {
            FallbackReason::InvalidUtf8
        }
        JiterErrorType::JsonError(_) => FallbackReason::InvalidJson,
    };
    Cut::Fallback(reason)
}
