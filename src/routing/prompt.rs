//! The walk over a prompt-carrying JSON body (which may be cut anywhere) that encodes the
//! parts of its routing key, with jiter's pull parser and partial strings allowed.

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
    /// A string field (or the first string of an array), cut at this many characters.
    Text(&'static str, usize),
}

// Part tags of the canonical encoding.
const MODEL: u8 = b'm';
const ROLE: u8 = b'r';
const CONTENT: u8 = b'c';
const PROMPT: u8 = b'p';

/// Walks the top-level object, encoding the model (when it comes first) and the prompt part.
/// `Ok(true)`: the key is complete; `Ok(false)`: the object ended without a prompt. A cut body
/// is an EOF error.
// Inlined into its one caller: out of line it cost 4% of a key extraction (`cargo bench --bench
// routing -- key_16KiB`), in line it is level with the walk before it moved to this module.
#[inline(always)]
pub fn scan(body: &[u8], enc: &mut KeyEncoder, prompt: PromptField) -> Result<bool, JiterError> {
    enum Field {
        Model,
        Prompt,
        Other,
    }
    let prompt_name = match prompt {
        PromptField::Messages => "messages",
        PromptField::Text(name, _) => name,
    };
    let classify = |key: &str| {
        if key == "model" {
            Field::Model
        } else if key == prompt_name {
            Field::Prompt
        } else {
            Field::Other
        }
    };
    let mut j = Jiter::new(body).with_allow_partial_strings();
    let mut key = j.next_object()?.map(classify);
    while let Some(field) = key {
        match field {
            Field::Model => {
                enc.part(MODEL, j.next_str()?.as_bytes());
                ensure_not_cut(&j, body.len())?;
            }
            Field::Prompt => {
                match prompt {
                    PromptField::Messages => scan_messages(&mut j, enc)?,
                    PromptField::Text(_, chars) => scan_text(&mut j, enc, chars, body.len())?,
                }
                return Ok(true);
            }
            Field::Other => j.next_skip()?,
        }
        key = j.next_key()?.map(classify);
    }
    Ok(false)
}

/// Encodes messages up to the first `user` one, or all of them when none is. The encoder is
/// marked before each message, so that the mark ends before the first user message: the part
/// that conversations sharing a system prompt share.
fn scan_messages(j: &mut Jiter<'_>, enc: &mut KeyEncoder) -> Result<(), JiterError> {
    let mut next = j.next_array()?;
    while let Some(peek) = next {
        if peek != Peek::Object {
            return Err(wrong_shape(j));
        }
        enc.mark();
        if scan_message(j, enc)? {
            return Ok(());
        }
        next = j.array_step()?;
    }
    Ok(())
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
            Field::Content => scan_content(j, enc)?,
            Field::Other => j.next_skip()?,
        }
        key = j.next_key()?.map(classify);
    }
    Ok(is_user)
}

/// A message's content: a string, null, or an array of parts whose `text` fields count.
fn scan_content(j: &mut Jiter<'_>, enc: &mut KeyEncoder) -> Result<(), JiterError> {
    match j.peek()? {
        Peek::String => enc.part(CONTENT, j.known_str()?.as_bytes()),
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
                        enc.part(CONTENT, j.known_str()?.as_bytes());
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

/// A prompt string, or the first string of an array, cut at `chars` characters.
fn scan_text(
    j: &mut Jiter<'_>,
    enc: &mut KeyEncoder,
    chars: usize,
    len: usize,
) -> Result<(), JiterError> {
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
    Ok(())
}
