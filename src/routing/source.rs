//! Where a routing key came from, and why a prompt-carrying request fell back.

/// Which source produced a key. All but the last two are what `routing.key.sources` lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeySource {
    SessionHeader,
    Chat,
    Completions,
    Generate,
    Messages,
    Responses,
    ClientAddr,
    None,
}

impl KeySource {
    pub fn as_str(self) -> &'static str {
        match self {
            KeySource::SessionHeader => "session_header",
            KeySource::Chat => "chat",
            KeySource::Completions => "completions",
            KeySource::Generate => "generate",
            KeySource::Messages => "messages",
            KeySource::Responses => "responses",
            KeySource::ClientAddr => "client_addr",
            KeySource::None => "none",
        }
    }
}

/// Why a prompt-carrying request fell back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// Not a prompt route, and no session header.
    NoKeySource,
    EmptyBody,
    /// Not JSON, or JSON that breaks off before the body ends.
    InvalidJson,
    InvalidUtf8,
    /// JSON, but not an object with the fields this route expects.
    WrongShape,
    TooDeep,
    /// No messages, prompt or text field.
    NoPrompt,
    /// The peek limit was reached before any part of the key.
    PeekLimit,
}

impl FallbackReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackReason::NoKeySource => "no_key_source",
            FallbackReason::EmptyBody => "empty_body",
            FallbackReason::InvalidJson => "invalid_json",
            FallbackReason::InvalidUtf8 => "invalid_utf8",
            FallbackReason::WrongShape => "wrong_shape",
            FallbackReason::TooDeep => "too_deep",
            FallbackReason::NoPrompt => "no_prompt",
            FallbackReason::PeekLimit => "peek_limit",
        }
    }
}
