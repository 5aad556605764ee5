//! Any prefix of any body, under every kind of end: never a panic, a cut body never yields a key
//! that differs from the full one, and why a body falls back does not depend on where it was cut.

use super::*;

/// Every byte offset of a sample request, under every kind of end: never a panic, a cut body
/// never yields a key that differs from the full one, and only a complete body is final.
#[test]
fn truncation_at_every_offset_never_panics() {
    let body = format!(
        r#"{{"model":"qwen2.5-7b","temperature":0.2,"messages":[{{"role":"system","content":"Tu es un assistant \"précis\" \u00e9\n{}"}},{{"role":"user","content":[{{"type":"text","text":"第一个问题 🚀 \\ud83d\\ude80"}}]}},{{"role":"assistant","content":null,"tool_calls":[{{"id":"1"}}]}},{{"role":"user","content":"next"}}],"max_tokens":64}}"#,
        "règle ".repeat(20)
    );
    let full = full_key(CHAT, &body);
    assert_eq!(full.source, KeySource::Chat);
    let bytes = body.as_bytes();
    for cut in 0..=bytes.len() {
        let prefix = &bytes[..cut];
        match key_of(CHAT, prefix, BodyEnd::More) {
            Extract::NeedMore => {}
            Extract::Key(k) => assert_eq!(k, full, "cut at {cut} gave a different key"),
            Extract::Deeper(k) => assert_eq!(
                (k.hash, k.source),
                (full.hash, full.source),
                "cut at {cut} gave a different key"
            ),
        }
        let _ = key_of(CHAT, prefix, BodyEnd::Limit);
        let _ = key_of(CHAT, prefix, BodyEnd::Complete);
        let _ = key_of("/v1/completions", prefix, BodyEnd::More);
        let _ = key_of("/generate", prefix, BodyEnd::Limit);
    }
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..512)) {
        for path in [CHAT, "/v1/completions", "/generate"] {
            for end in [BodyEnd::More, BodyEnd::Complete, BodyEnd::Limit] {
                let _ = key_of(path, &body, end);
            }
        }
    }

    #[test]
    fn arbitrary_json_never_panics(v in json_value()) {
        let body = serde_json::json!({"model": "m", "messages": v.clone(), "prompt": v.clone(), "text": v}).to_string();
        for path in [CHAT, "/v1/completions", "/generate"] {
            let _ = key_of(path, body.as_bytes(), BodyEnd::Complete);
        }
    }
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        "[a-z\"\\\\é🚀]{0,8}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
            prop::collection::btree_map("role|content|text|type|[a-z]{1,3}", inner, 0..4)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A body of the wrong type is told from broken JSON only once it has all arrived: the reason
/// a cut one falls back for must not depend on where the cut fell (found by the `key` fuzzer).
#[test]
fn a_wrong_typed_body_waits_for_its_end_to_tell_why_it_falls_back() {
    let body = br#"["a", "b"]}"#;
    for cut in 1..body.len() - 1 {
        assert_eq!(
            key_of(CHAT, &body[..cut], BodyEnd::More),
            Extract::NeedMore,
            "cut at {cut}"
        );
    }
    let whole = full_key(CHAT, std::str::from_utf8(body).unwrap());
    assert_eq!(whole.fallback, Some(FallbackReason::WrongShape));
    let truncated = full_key(CHAT, r#"["a", "b"#);
    assert_eq!(truncated.fallback, Some(FallbackReason::InvalidJson));
    // A number that has arrived up to the cut may still grow into an invalid one.
    assert_eq!(key_of(CHAT, b"6", BodyEnd::More), Extract::NeedMore);
    assert_eq!(
        full_key(CHAT, "66en").fallback,
        Some(FallbackReason::InvalidJson)
    );
}
