//! The keys of the Anthropic Messages and OpenAI Responses bodies: the conversation's opening
//! (system prompt or instructions before it, then the first user message), stable across
//! turns, distinct across conversations, and never a panic on a malformed or cut body.

use super::*;

const MESSAGES: &str = "/v1/messages";
const RESPONSES: &str = "/v1/responses";

fn key(path: &str, body: &str) -> RoutingKey {
    match key_of(path, body.as_bytes(), BodyEnd::Complete) {
        Extract::Key(k) => k,
        other => panic!("a complete body needs no more: {other:?}"),
    }
}

/// An Anthropic conversation of `turns` user turns, the system prompt as a string or blocks,
/// written before the messages (`json!` would sort the fields).
fn anthropic(system: serde_json::Value, first: &str, turns: usize) -> String {
    let mut messages = vec![serde_json::json!({"role": "user", "content": first})];
    for t in 1..turns {
        messages.push(serde_json::json!({"role": "assistant", "content": [{"type": "text", "text": format!("answer {t}")}]}));
        messages.push(serde_json::json!({"role": "user", "content": [{"type": "text", "text": format!("q {t}")}]}));
    }
    let messages = serde_json::Value::from(messages);
    format!(r#"{{"model":"m","max_tokens":64,"system":{system},"messages":{messages}}}"#)
}

#[test]
fn a_messages_conversation_keeps_its_key_and_another_differs() {
    let system = serde_json::json!("You are terse.");
    let first = key(MESSAGES, &anthropic(system.clone(), "hello", 1));
    assert_eq!(first.source, KeySource::Messages);
    assert!(first.hash.is_some() && first.fallback.is_none());
    for turns in 2..5 {
        assert_eq!(
            key(MESSAGES, &anthropic(system.clone(), "hello", turns)).hash,
            first.hash
        );
    }
    let other = key(MESSAGES, &anthropic(system.clone(), "bonjour", 3));
    assert_ne!(other.hash, first.hash);
    let other_system = key(
        MESSAGES,
        &anthropic(serde_json::json!("Be verbose."), "hello", 1),
    );
    assert_ne!(other_system.hash, first.hash);
    // A system prompt of text blocks counts by its text.
    let blocks = serde_json::json!([{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]);
    assert_eq!(
        key(MESSAGES, &anthropic(blocks, "hello", 2)).hash,
        first.hash
    );
    // The first message's content as blocks keys as the same text (`json!` wrote `content`
    // before `role`: a message's fields count in their order).
    let as_blocks = r#"{"model":"m","system":"You are terse.","messages":[{"content":[{"type":"text","text":"hello"}],"role":"user"}]}"#;
    assert_eq!(key(MESSAGES, as_blocks).hash, first.hash);
}

#[test]
fn a_system_prompt_after_the_messages_is_left_out_like_a_model() {
    let before = key(MESSAGES, &anthropic(serde_json::json!("S"), "hello", 2));
    let after = r#"{"messages":[{"role":"user","content":"hello"}],"system":"S"}"#;
    let after = key_of(MESSAGES, after.as_bytes(), BodyEnd::Complete);
    let without = r#"{"messages":[{"role":"user","content":"hello"}]}"#;
    let without = key_of(MESSAGES, without.as_bytes(), BodyEnd::Complete);
    let hash = |e: Extract| match e {
        Extract::Key(k) => k.hash,
        other => panic!("{other:?}"),
    };
    assert_eq!(hash(after), hash(without));
    assert_ne!(before.hash, hash(without));
}

fn responses(instructions: &str, input: impl std::fmt::Display) -> String {
    let instructions = serde_json::Value::from(instructions);
    format!(r#"{{"model":"m","instructions":{instructions},"input":{input},"store":true}}"#)
}

#[test]
fn a_responses_conversation_keys_by_instructions_and_first_input() {
    let first = key(
        RESPONSES,
        &responses("Be brief.", serde_json::json!("hello")),
    );
    assert_eq!(first.source, KeySource::Responses);
    assert!(first.hash.is_some());
    // The history sent back as items, the first of them the string's user message (written
    // by hand: `json!` would put `content` before `role`, and a message's fields count in
    // their order).
    let items = r#"[{"role":"user","content":"hello"},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"hi"}]},{"role":"user","content":[{"type":"input_text","text":"more"}]}]"#;
    assert_eq!(
        key(RESPONSES, &responses("Be brief.", items)).hash,
        first.hash
    );
    let parts =
        r#"[{"type":"message","role":"user","content":[{"type":"input_text","text":"hello"}]}]"#;
    assert_eq!(
        key(RESPONSES, &responses("Be brief.", parts)).hash,
        first.hash
    );
    let other = key(RESPONSES, &responses("Be brief.", serde_json::json!("bye")));
    assert_ne!(other.hash, first.hash);
    let other = key(
        RESPONSES,
        &responses("Be long.", serde_json::json!("hello")),
    );
    assert_ne!(other.hash, first.hash);
}

#[test]
fn the_previous_response_is_read_wherever_it_comes() {
    let body = br#"{"input":"x","model":"m","previous_response_id":"resp_1","store":true}"#;
    assert_eq!(previous_in(body).as_deref(), Some("resp_1"));
    assert_eq!(previous_in(br#"{"previous_response_id":null}"#), None);
    assert_eq!(previous_in(br#"{"previous_response_id":"resp_"#), None);
    assert_eq!(previous_in(b"nonsense"), None);
}

#[test]
fn malformed_bodies_fall_back_with_a_reason() {
    let cases: &[(&str, &[u8], FallbackReason)] = &[
        (MESSAGES, b"", FallbackReason::EmptyBody),
        (MESSAGES, b"not json", FallbackReason::InvalidJson),
        (
            MESSAGES,
            br#"{"messages":"hi"}"#,
            FallbackReason::WrongShape,
        ),
        (
            MESSAGES,
            br#"{"system":7,"messages":[]}"#,
            FallbackReason::WrongShape,
        ),
        (
            MESSAGES,
            br#"{"system":[1],"messages":[]}"#,
            FallbackReason::WrongShape,
        ),
        (MESSAGES, br#"{"model":"m"}"#, FallbackReason::NoPrompt),
        (RESPONSES, br#"{"input":7}"#, FallbackReason::WrongShape),
        (RESPONSES, br#"{"input":[1]}"#, FallbackReason::WrongShape),
        (
            RESPONSES,
            br#"{"instructions":{},"input":"x"}"#,
            FallbackReason::WrongShape,
        ),
        (
            RESPONSES,
            br#"{"previous_response_id":"r"}"#,
            FallbackReason::NoPrompt,
        ),
        (RESPONSES, br#"{"input":"x"#, FallbackReason::InvalidJson),
        (RESPONSES, b"[]", FallbackReason::WrongShape),
    ];
    for (path, body, reason) in cases {
        match key_of(path, body, BodyEnd::Complete) {
            Extract::Key(k) => assert_eq!(
                k.fallback,
                Some(*reason),
                "{path} {}",
                String::from_utf8_lossy(body)
            ),
            other => panic!("{path}: {other:?}"),
        }
    }
}

/// Every prefix of a body, under every kind of end: never a panic, and a cut body never keys
/// other than the full one.
#[test]
fn every_cut_of_either_body_is_safe() {
    let bodies = [
        (
            MESSAGES,
            anthropic(
                serde_json::json!([{"type": "text", "text": "Système \"ü\" 🚀"}]),
                "q ✓",
                3,
            ),
        ),
        (
            RESPONSES,
            responses(
                "Instr \u{e9}",
                serde_json::json!([{"role": "user", "content": [{"type": "input_text", "text": "第一"}]}, {"role": "user", "content": "2"}]),
            ),
        ),
        (
            RESPONSES,
            responses("I", serde_json::json!("plain \\ escaped")),
        ),
    ];
    for (path, body) in bodies {
        let full = key(path, &body);
        let bytes = body.as_bytes();
        for cut in 0..=bytes.len() {
            match key_of(path, &bytes[..cut], BodyEnd::More) {
                Extract::NeedMore => {}
                Extract::Key(k) | Extract::Deeper(k) => {
                    assert_eq!(k.hash, full.hash, "{path} cut at {cut}")
                }
            }
            let _ = key_of(path, &bytes[..cut], BodyEnd::Limit);
            let _ = key_of(path, &bytes[..cut], BodyEnd::Complete);
            let _ = previous_in(&bytes[..cut]);
        }
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..256)) {
        for end in [BodyEnd::More, BodyEnd::Limit, BodyEnd::Complete] {
            let _ = key_of(MESSAGES, &body, end);
            let _ = key_of(RESPONSES, &body, end);
        }
        let _ = previous_in(&body);
    }
}
