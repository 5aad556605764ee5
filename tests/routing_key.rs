//! Routing-key extraction: stable across turns, distinct across conversations, and safe on any
//! prefix of any body.

use http::{HeaderMap, Method};
use prefixlb::routing::*;
use proptest::prelude::*;

// The Anthropic Messages and OpenAI Responses shapes, with this file's helpers.
#[path = "routing_key/api_shapes.rs"]
mod api_shapes;
// Where a key comes from besides the body, and why it falls back.
#[path = "routing_key/fallback.rs"]
mod fallback;
// Cut and arbitrary bodies: never a panic, never a key that a longer cut contradicts.
#[path = "routing_key/robustness.rs"]
mod robustness;

const CHAT: &str = "/v1/chat/completions";

fn extractor() -> KeyExtractor {
    KeyExtractor::default()
}

fn key_of(path: &str, body: &[u8], end: BodyEnd) -> Extract {
    extractor().key_for(&RequestParts {
        method: &Method::POST,
        path,
        headers: &HeaderMap::new(),
        client: Some("192.0.2.7".parse().unwrap()),
        body,
        end,
    })
}

/// What of an extraction routes: the key's point and source, once it is complete.
fn routes(e: Extract) -> Option<(Option<u64>, KeySource)> {
    match e {
        Extract::Key(k) | Extract::Deeper(k) => Some((k.hash, k.source)),
        Extract::NeedMore => None,
    }
}

fn full_key(path: &str, body: &str) -> RoutingKey {
    match key_of(path, body.as_bytes(), BodyEnd::Complete) {
        Extract::Key(k) => k,
        other => panic!("a complete body needs no more: {other:?}"),
    }
}

fn conversation(system: &str, first: &str, turns: usize) -> String {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": system}),
        serde_json::json!({"role": "user", "content": first}),
    ];
    for t in 1..turns {
        messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {t} ✓")}));
        messages.push(serde_json::json!({"role": "user", "content": format!("follow-up {t}")}));
    }
    serde_json::json!({"model": "llama-3-8b", "stream": true, "messages": messages}).to_string()
}

/// Conversations that share a system prompt share the blocks of it, and a conversation's turn
/// holds every block of the turns before: where those went is where they are cached.
#[test]
fn prompts_name_the_blocks_they_share() {
    let system = "Answer from the attached contract. ".repeat(200);
    let a = full_key(CHAT, &conversation(&system, "Who pays the deposit?", 1));
    let a5 = full_key(CHAT, &conversation(&system, "Who pays the deposit?", 5));
    let b = full_key(CHAT, &conversation(&system, "When does it end?", 1));
    let other = full_key(CHAT, &conversation("Another contract.", "Who pays?", 1));
    assert_ne!(a.hash, b.hash);
    // The system prompt's 7,000 bytes are six whole blocks, the same in both.
    let whole = system.len() / BLOCK_BYTES as usize;
    assert_eq!(whole, 6);
    assert_eq!(a.blocks.hashes()[..whole], b.blocks.hashes()[..whole]);
    assert_ne!(a.blocks.hashes()[whole], b.blocks.hashes()[whole]);
    assert!(a5.blocks.hashes().starts_with(a.blocks.hashes()));
    assert_ne!(other.blocks.hash(0), a.blocks.hash(0));
    // Its key ends with the first question, where turn 1's messages end: turn 5 names that
    // point too.
    let k = a.blocks.key_point().unwrap();
    let tail = r#"],"model":"llama-3-8b","stream":true}"#.len() as u32;
    assert_eq!(a.blocks.end(k) + tail, a.blocks.bytes());
    assert_eq!(a5.blocks.key_point(), Some(k));
    assert_eq!(a5.blocks.hash(k), a.blocks.hash(k));
    assert!(a5.blocks.bytes() > a.blocks.bytes());
    // A completions prompt is named past its key (its first 2048 characters) too.
    let body = serde_json::json!({"prompt": system}).to_string();
    let c = full_key("/v1/completions", &body);
    assert_eq!(c.blocks.len(), whole + 1, "six blocks and the key's end");
}

/// A conversation's first turn ends with its key: it is marked as an opening, which no peer can
/// hold more of than its system prompt. Later turns are marked as such; a raw prompt is
/// neither.
#[test]
fn a_first_turn_is_an_opening() {
    let first = conversation("You are terse.", "Hello?", 1);
    assert!(full_key(CHAT, &first).blocks.is_opening());
    assert!(!full_key(CHAT, &first).blocks.is_later_turn());
    let spaced = first.replace("}]", "} \n ]");
    assert_ne!(spaced, first);
    assert!(full_key(CHAT, &spaced).blocks.is_opening());
    let later = conversation("You are terse.", "Hello?", 2);
    assert!(!full_key(CHAT, &later).blocks.is_opening());
    assert!(full_key(CHAT, &later).blocks.is_later_turn());
    // A first message from the user, and a trailing assistant prefill after it.
    let prefilled = serde_json::json!({"messages": [
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Well,"},
    ]});
    assert!(!full_key(CHAT, &prefilled.to_string()).blocks.is_opening());
    let raw = serde_json::json!({"prompt": "Hello?"}).to_string();
    let raw = full_key("/v1/completions", &raw).blocks;
    assert!(!raw.is_opening() && !raw.is_later_turn());
}

#[test]
fn chat_key_is_stable_across_turns_and_differs_across_conversations() {
    let system = "You are a careful clinical assistant. ".repeat(40);
    let t1 = full_key(CHAT, &conversation(&system, "Patient A, 54, chest pain", 1));
    let t5 = full_key(CHAT, &conversation(&system, "Patient A, 54, chest pain", 5));
    let other = full_key(CHAT, &conversation(&system, "Patient B, 31, migraine", 1));
    assert_eq!(t1.source, KeySource::Chat);
    assert_eq!(t1.fallback, None);
    assert_eq!((t1.hash, t1.source), (t5.hash, t5.source));
    assert_ne!(t1.hash, other.hash);
    // A first turn shorter than any fixed cut still matches its later turns.
    let short1 = full_key(CHAT, &conversation("Be brief.", "hi", 1));
    let short5 = full_key(CHAT, &conversation("Be brief.", "hi", 5));
    assert_eq!(short1.hash, short5.hash);
}

#[test]
fn chat_key_reads_text_parts_and_developer_messages() {
    let as_string = r#"{"model":"m","messages":[{"role":"developer","content":"rules"},{"role":"user","content":"question"}]}"#;
    let as_parts = r#"{"model":"m","messages":[{"role":"developer","content":[{"type":"text","text":"rules"}]},{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}},{"type":"text","text":"question"}]}]}"#;
    // The key reads the text; the blocks are named over the bytes as sent.
    assert_eq!(
        full_key(CHAT, as_string).hash,
        full_key(CHAT, as_parts).hash
    );
    let other_rules = as_string.replace("rules", "other rules");
    assert_ne!(
        full_key(CHAT, as_string).hash,
        full_key(CHAT, &other_rules).hash
    );
    let other_model = as_string.replace("\"m\"", "\"n\"");
    assert_ne!(
        full_key(CHAT, as_string).hash,
        full_key(CHAT, &other_model).hash
    );
}

#[test]
fn model_counts_only_before_the_prompt() {
    let first = r#"{"model":"m1","messages":[{"role":"user","content":"q"}]}"#;
    assert_ne!(
        full_key(CHAT, first),
        full_key(CHAT, &first.replace("m1", "m2"))
    );
    // After the messages (as openai-python and sorted-key encoders send it) it is not read:
    // a long turn cut at the peek limit never reaches it, and must key like a short one.
    let last = r#"{"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"}],"model":"m1"}"#;
    assert_eq!(
        full_key(CHAT, last),
        full_key(CHAT, &last.replace("m1", "m2"))
    );
}

#[test]
fn a_long_turn_cut_at_the_peek_limit_keys_like_its_first_turn() {
    // Model last, as openai-python sends it; the cut falls deep in the history.
    let system = "Follow the clinic's triage protocol. ".repeat(50);
    let turn = |n: usize| {
        let mut messages = vec![
            serde_json::json!({"role": "system", "content": system}),
            serde_json::json!({"role": "user", "content": "first question"}),
        ];
        for t in 0..n {
            messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {t} ").repeat(400)}));
            messages.push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
        }
        format!(
            r#"{{"messages":{},"stream":true,"model":"m"}}"#,
            serde_json::Value::from(messages)
        )
    };
    let first = full_key(CHAT, &turn(0));
    let long = turn(40);
    assert!(long.len() > 64 * 1024);
    assert_eq!(
        routes(key_of(CHAT, &long.as_bytes()[..64 * 1024], BodyEnd::Limit)),
        routes(Extract::Key(first))
    );
}

#[test]
fn key_is_complete_before_the_body_is() {
    let rest = (0..20)
        .map(|t| {
            format!(
                r#",{{"role":"assistant","content":"a{t}"}},{{"role":"user","content":"q{t}"}}"#
            )
        })
        .collect::<String>();
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"sys"}},{{"role":"user","content":"first question"}}{rest}]}}"#
    );
    let end_of_first = body.find("first question").unwrap() + "first question\"}".len();
    // Up to the end of the first user message the key needs more; right after, it is done,
    // and only the rest of the prompt's blocks would come of more.
    assert_eq!(
        key_of(CHAT, &body.as_bytes()[..end_of_first - 3], BodyEnd::More),
        Extract::NeedMore
    );
    let early = key_of(CHAT, &body.as_bytes()[..end_of_first + 1], BodyEnd::More);
    assert!(matches!(early, Extract::Deeper(_)), "{early:?}");
    assert_eq!(routes(early), routes(Extract::Key(full_key(CHAT, &body))));
}

#[test]
fn completions_and_generate_use_a_character_prefix() {
    let long = "α".repeat(3000);
    let a = format!(r#"{{"model":"m","prompt":"{long} tail one"}}"#);
    let b = format!(r#"{{"model":"m","prompt":"{long} tail two"}}"#);
    let ka = full_key("/v1/completions", &a);
    assert_eq!(ka.source, KeySource::Completions);
    assert_eq!(
        ka.hash,
        full_key("/v1/completions", &b).hash,
        "only the first 2048 chars count"
    );
    let arr = format!(r#"{{"model":"m","prompt":["{long} x","other"]}}"#);
    assert_eq!(ka.hash, full_key("/v1/completions", &arr).hash);
    assert_ne!(
        ka.hash,
        full_key("/v1/completions", r#"{"model":"m","prompt":"short"}"#).hash
    );
    // A cut prompt already 2048 characters long is complete as a key without the rest of the
    // body.
    let cut = &a.as_bytes()[..4200];
    assert_eq!(
        routes(key_of("/v1/completions", cut, BodyEnd::More)),
        routes(Extract::Key(ka))
    );
    assert_eq!(
        key_of("/v1/completions", &a.as_bytes()[..3000], BodyEnd::More),
        Extract::NeedMore
    );

    let g = full_key(
        "/generate",
        &format!(r#"{{"text":"{long}","sampling_params":{{}}}}"#),
    );
    assert_eq!(g.source, KeySource::Generate);
}
