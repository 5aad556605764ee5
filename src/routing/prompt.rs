//! The walk over a prompt-carrying JSON body (which may be cut anywhere) that encodes the
//! parts of its routing key, with jiter's pull parser and partial strings allowed, and notes
//! where in the body the prompt and its key lie, for the prompt's block chain.

use jiter::{Jiter, JiterError, JiterErrorType, JsonErrorType, Peek};

use super::hash::KeyEncoder;

/// Whether a parse error comes from the body ending, not from bad input.
pub fn is_cut(e: &JiterError, len: usize) -> bool {
    match &e.error_type {
        JiterErrorType::JsonError(t) => {
            matches!(
                t,
                JsonErrorType::EofWhileParsingList
                    | JsonErrorType::EofWhileParsingObject
                    | JsonErrorType::EofWhileParsingString
                    | JsonErrorType::EofWhileParsingValue
                    | JsonErrorType::UnexpectedEndOfHexEscape
            ) || e.index >= len
        }
        JiterErrorType::WrongType { .. } => false,
    }
}

/// With partial strings allowed, a string that runs to the end of the data may be cut: only a
/// byte after it proves it complete.
fn ensure_not_cut(j: &Jiter<'_>, len: usize) -> Result<(), JiterError> {
    if j.current_index() < len {
        return Ok(());
    }
    Err(JiterError {
        error_type: JiterErrorType::JsonError(JsonErrorType::EofWhileParsingString),
        index: len,
    })
}

/// A shape error found by the walk itself rather than by jiter.
fn wrong_shape(j: &Jiter<'_>) -> JiterError {
    JiterError {
        error_type: JiterErrorType::WrongType {
            expected: jiter::JsonType::Object,
            actual: jiter::JsonType::Array,
        },
        index: j.current_index(),
    }
}

#[derive(Clone, Copy)]
pub enum PromptField {
    /// Chat `messages`: every message up to and including the first `user` one.
    Messages,
    /// Anthropic `messages`, as chat's, after a `system` that comes before them.
    AnthropicMessages,
    /// Responses `input` (a string, or items as chat's messages), after an `instructions`
    /// that comes before it.
    ResponsesInput,
    /// A string field (or the first string of an array), cut at this many characters.
    Text(&'static str, usize),
}

// Part tags of the canonical encoding.
const MODEL: u8 = b'm';
const ROLE: u8 = b'r';
const CONTENT: u8 = b'c';
const PROMPT: u8 = b'p';
const SYSTEM: u8 = b's';

/// Where a body's prompt lies, as byte offsets into it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Span {
    /// The `model` value, when it comes before the prompt.
    pub model: Option<(usize, usize)>,
    /// The start of the prompt's value.
    pub start: Option<usize>,
    /// Where the key ends, once it is complete.
    pub key_end: Option<usize>,
}

/// Walks the top-level object, encoding the model (when it comes first) and the prompt part,
/// and noting where they are in `span`. `Ok(true)`: the key is complete; `Ok(false)`: the
/// object ended without a prompt. A cut body is an EOF error.
// Inlined into its one caller: out of line it cost 4% of a key extraction (`cargo bench --bench
// routing -- key_16KiB`), in line it is level with the walk before it moved to this module.
#[inline(always)]
pub fn scan(
    body: &[u8],
    enc: &mut KeyEncoder,
    prompt: PromptField,
    span: &mut Span,
) -> Result<bool, JiterError> {
    enum Field {
        Model,
        Preamble,
        Prompt,
        Other,
    }
    // Like `model`, the preamble counts only before the prompt: after it, reaching it means
    // reading the whole history, and a key must not change between a short turn and a long one.
    let (prompt_name, preamble) = match prompt {
        PromptField::Messages => ("messages", None),
        PromptField::AnthropicMessages => ("messages", Some("system")),
        PromptField::ResponsesInput => ("input", Some("instructions")),
        PromptField::Text(name, _) => (name, None),
    };
    let classify = |key: &str| {
        if key == "model" {
            Field::Model
        } else if key == prompt_name {
            Field::Prompt
        } else if Some(key) == preamble {
            Field::Preamble
        } else {
            Field::Other
        }
    };
    let mut j = Jiter::new(body).with_allow_partial_strings();
    let mut key = j.next_object()?.map(classify);
    while let Some(field) = key {
        match field {
            Field::Model => {
                let from = j.current_index();
                enc.part(MODEL, j.next_str()?.as_bytes());
                ensure_not_cut(&j, body.len())?;
                span.model = Some((from, j.current_index()));
            }
            Field::Preamble => scan_content(&mut j, enc, SYSTEM)?,
            Field::Prompt => {
                let start = j.current_index();
                span.start = Some(start);
                let key_end = match prompt {
                    PromptField::Messages | PromptField::AnthropicMessages => {
                        scan_messages(&mut j, enc)?
                    }
                    PromptField::ResponsesInput => scan_input(&mut j, enc, body.len())?,
                    PromptField::Text(_, chars) => {
                        // The raw offset of the cut is not known past an escape; the decoded
                        // length stands for it, the same for every body with this key.
                        start + 1 + scan_text(&mut j, enc, chars, body.len())?
                    }
                };
                span.key_end = Some(key_end.min(body.len()));
                return Ok(true);
            }
            Field::Other => j.next_skip()?,
        }
        key = j.next_key()?.map(classify);
    }
    Ok(false)
}

/// Encodes messages up to the first `user` one, or all of them when none is; returns the
/// offset where that ends.
fn scan_messages(j: &mut Jiter<'_>, enc: &mut KeyEncoder) -> Result<usize, JiterError> {
    let mut next = j.next_array()?;
    while let Some(peek) = next {
        if peek != Peek::Object {
            return Err(wrong_shape(j));
        }
        if scan_message(j, enc)? {
            return Ok(j.current_index());
        }
        next = j.array_step()?;
    }
    Ok(j.current_index())
}

/// A Responses `input`: items are read as messages, and a string as the user message it
/// stands for, so that a first turn sent as a string keys as the history that repeats it.
fn scan_input(j: &mut Jiter<'_>, enc: &mut KeyEncoder, len: usize) -> Result<usize, JiterError> {
    if j.peek()? != Peek::String {
        return scan_messages(j, enc);
    }
    enc.part(ROLE, b"user");
    enc.part(CONTENT, j.known_str()?.as_bytes());
    ensure_not_cut(j, len)?;
    Ok(j.current_index())
}

/// Encodes one message's role and text; true when it is a `user` message.
fn scan_message(j: &mut Jiter<'_>, enc: &mut KeyEncoder) -> Result<bool, JiterError> {
    enum Field {
        Role,
        Content,
        Other,
    }
    let classify = |k: &str| match k {
        "role" => Field::Role,
        "content" => Field::Content,
        _ => Field::Other,
    };
    let mut is_user = false;
    let mut key = j.known_object()?.map(classify);
    while let Some(field) = key {
        match field {
            Field::Role => {
                let role = j.next_str()?;
                is_user = role == "user";
                enc.part(ROLE, role.as_bytes());
            }
            Field::Content => scan_content(j, enc, CONTENT)?,
            Field::Other => j.next_skip()?,
        }
        key = j.next_key()?.map(classify);
    }
    Ok(is_user)
}

/// A message's content (or a system prompt, tagged `tag`): a string, null, or an array of parts
/// whose `text` fields count.
fn scan_content(j: &mut Jiter<'_>, enc: &mut KeyEncoder, tag: u8) -> Result<(), JiterError> {
    match j.peek()? {
        Peek::String => enc.part(tag, j.known_str()?.as_bytes()),
        Peek::Null => j.known_null()?,
        Peek::Array => {
            let mut next = j.known_array()?;
            while let Some(peek) = next {
                if peek != Peek::Object {
                    return Err(wrong_shape(j));
                }
                let mut key = j.known_object()?.map(|k| k == "text");
                while let Some(is_text) = key {
                    if is_text && j.peek()? == Peek::String {
                        enc.part(tag, j.known_str()?.as_bytes());
                    } else {
                        j.next_skip()?;
                    }
                    key = j.next_key()?.map(|k| k == "text");
                }
                next = j.array_step()?;
            }
        }
        _ => return Err(wrong_shape(j)),
    }
    Ok(())
}

/// A prompt string, or the first string of an array, cut at `chars` characters; returns the
/// bytes of text in the key.
fn scan_text(
    j: &mut Jiter<'_>,
    enc: &mut KeyEncoder,
    chars: usize,
    len: usize,
) -> Result<usize, JiterError> {
    match j.peek()? {
        Peek::String => {}
        Peek::Array => match j.known_array()? {
            Some(Peek::String) => {}
            _ => return Err(wrong_shape(j)),
        },
        _ => return Err(wrong_shape(j)),
    }
    let text = j.known_str()?;
    let (cut, long_enough) = match text.char_indices().nth(chars) {
        Some((i, _)) => (i, true),
        None => (text.len(), false),
    };
    enc.part(PROMPT, &text.as_bytes()[..cut]);
    // A partial string already `chars` long is complete as a key.
    if !long_enough {
        ensure_not_cut(j, len)?;
    }
    Ok(cut)
}

/// The `model` of a JSON body's top-level object, wherever it comes among the fields; `None`
/// when there is none, or the body is cut before it.
pub fn model(body: &[u8]) -> Option<String> {
    string_field(body, "model")
}

/// The string `field` of a JSON body's top-level object, wherever it comes; `None` when there
/// is none, it is not a string, or the body is cut before it.
pub fn string_field(body: &[u8], field: &str) -> Option<String> {
    let mut j = Jiter::new(body);
    let mut key = j.next_object().ok()?;
    while let Some(name) = key {
        if name == field {
            return j.next_str().ok().map(str::to_owned);
        }
        j.next_skip().ok()?;
        key = j.next_key().ok()?;
    }
    None
}
