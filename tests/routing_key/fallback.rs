//! Where a key comes from besides the body (a session header, the client's address), and the
//! reason each kind of body that yields no key falls back for, the peek limit's included.

use http::HeaderValue;

use super::*;

/// A session header names the key's point on the ring, whatever the body says; the body of a
/// prompt route is still read for the prompt's blocks, as it would be without the header, so
/// that sessions sharing a document are priced by what each peer holds of it. A body that
/// gives no prompt leaves the session's key alone, never the client's address.
#[test]
fn a_session_header_names_the_point_and_the_body_names_the_blocks() {
    let session = |id: &'static str| {
        let mut headers = HeaderMap::new();
        headers.insert("x-session-id", HeaderValue::from_static(id));
        headers
    };
    let ex = extractor();
    let key = |headers: &HeaderMap, path: &str, body: &[u8], end: BodyEnd| {
        ex.key_for(&RequestParts {
            method: &Method::POST,
            path,
            headers,
            client: Some("192.0.2.7".parse().unwrap()),
            body,
            end,
        })
    };
    let (s1, s2) = (session("conv-1"), session("conv-2"));
    let opening = conversation(&"A long shared document. ".repeat(100), "first question", 1);
    let Extract::Key(plain) = key(
        &HeaderMap::new(),
        CHAT,
        opening.as_bytes(),
        BodyEnd::Complete,
    ) else {
        panic!("a whole chat body gives its key")
    };
    let Extract::Key(k1) = key(&s1, CHAT, opening.as_bytes(), BodyEnd::Complete) else {
        panic!("a whole chat body gives its key")
    };
    assert_eq!(k1.source, KeySource::SessionHeader);
    assert_eq!(k1.fallback, None);
    assert_ne!(k1.hash, plain.hash, "the session names the point");
    assert_eq!(k1.blocks, plain.blocks, "the body names the blocks");
    assert!(k1.blocks.is_opening() && !k1.blocks.key_only());

    // Another session with the same body: another point, the same blocks.
    let Extract::Key(k2) = key(&s2, CHAT, opening.as_bytes(), BodyEnd::Complete) else {
        panic!()
    };
    assert_ne!(k2.hash, k1.hash);
    assert_eq!(k2.blocks, k1.blocks);

    // The same session with another prompt: the same point.
    let other = conversation("another document", "another question", 1);
    let Extract::Key(k3) = key(&s1, CHAT, other.as_bytes(), BodyEnd::Complete) else {
        panic!()
    };
    assert_eq!(k3.hash, k1.hash);
    assert_ne!(k3.blocks, k1.blocks);

    // A cut body waits for more, as without the header.
    assert_eq!(
        key(&s1, CHAT, b"{\"model\":", BodyEnd::More),
        Extract::NeedMore
    );
    // A body with no prompt, or one the peek limit cut short of its key: the session's key
    // alone, the prompt unknown.
    for (body, end) in [
        (&b"not json"[..], BodyEnd::Complete),
        (&b"{\"messages\":7}"[..], BodyEnd::Complete),
        (&b"   "[..], BodyEnd::Limit),
    ] {
        let Extract::Key(k) = key(&s1, CHAT, body, end) else {
            panic!("{body:?}")
        };
        assert_eq!(
            (k.hash, k.source, k.fallback),
            (k1.hash, KeySource::SessionHeader, None)
        );
        assert!(k.blocks.key_only(), "{body:?}");
    }
    // A route whose body carries no prompt is keyed by the header without reading it.
    let Extract::Key(models) = key(&s1, "/v1/models", b"", BodyEnd::More) else {
        panic!("a session header needs no body off the prompt routes")
    };
    assert_eq!(
        (models.hash, models.source),
        (k1.hash, KeySource::SessionHeader)
    );
    assert!(models.blocks.key_only());

    assert_eq!(ex.body_kind(&Method::POST, CHAT), Some(BodyKind::Chat));
    assert_eq!(ex.body_kind(&Method::GET, CHAT), None);
    assert_eq!(ex.body_kind(&Method::POST, "/v1/models"), None);
    let Extract::Key(models) = key_of("/v1/models", b"", BodyEnd::Complete) else {
        panic!()
    };
    assert_eq!(models.source, KeySource::ClientAddr);
    assert_eq!(models.fallback, Some(FallbackReason::NoKeySource));
}

#[test]
fn bad_bodies_fall_back_with_a_reason() {
    let cases: &[(&[u8], FallbackReason)] = &[
        (b"", FallbackReason::EmptyBody),
        (b"   ", FallbackReason::EmptyBody),
        (b"not json", FallbackReason::InvalidJson),
        (b"[1,2,3]", FallbackReason::WrongShape),
        (br#"{"messages":"hi"}"#, FallbackReason::WrongShape),
        (br#"{"messages":[1]}"#, FallbackReason::WrongShape),
        (
            br#"{"messages":[{"role":"user","content":7}]}"#,
            FallbackReason::WrongShape,
        ),
        (br#"{"model":"m"}"#, FallbackReason::NoPrompt),
        // Breaks off before the key is complete. (Past that point the rest is not read: the
        // upstream judges the body.)
        (
            br#"{"model":"m","messages":[{"role":"user","content":"x""#,
            FallbackReason::InvalidJson,
        ),
        (
            b"{\"model\":\"\xff\xfe\",\"messages\":[]}",
            FallbackReason::InvalidUtf8,
        ),
    ];
    for (body, reason) in cases {
        let Extract::Key(k) = key_of(CHAT, body, BodyEnd::Complete) else {
            panic!(
                "complete body {:?} asked for more",
                String::from_utf8_lossy(body)
            )
        };
        assert_eq!(
            k.fallback,
            Some(*reason),
            "{:?}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(k.source, KeySource::ClientAddr);
    }
    let deep = format!(
        r#"{{"extra":{}1{},"messages":[]}}"#,
        "[".repeat(5000),
        "]".repeat(5000)
    );
    let Extract::Key(k) = key_of(CHAT, deep.as_bytes(), BodyEnd::Complete) else {
        panic!()
    };
    assert_eq!(k.fallback, Some(FallbackReason::TooDeep));

    let none = KeyExtractor::new(KeyConfig {
        fallback: Fallback::None,
        ..KeyConfig::default()
    });
    let Extract::Key(k) = none.key_for(&RequestParts {
        method: &Method::POST,
        path: CHAT,
        headers: &HeaderMap::new(),
        client: Some("192.0.2.1".parse().unwrap()),
        body: b"oops",
        end: BodyEnd::Complete,
    }) else {
        panic!()
    };
    assert_eq!((k.hash, k.source), (None, KeySource::None));
}

#[test]
fn peek_limit_uses_the_key_as_far_as_it_goes() {
    let body = conversation("s", &"long first message ".repeat(500), 3);
    let cut = &body.as_bytes()[..2000];
    let Extract::Key(a) = key_of(CHAT, cut, BodyEnd::Limit) else {
        panic!()
    };
    assert_eq!(a.source, KeySource::Chat);
    let Extract::Key(b) = key_of(CHAT, &body.as_bytes()[..2000], BodyEnd::Limit) else {
        panic!()
    };
    assert_eq!(a, b);
    let Extract::Key(nothing) = key_of(CHAT, b"{\"mod", BodyEnd::Limit) else {
        panic!()
    };
    assert_eq!(nothing.fallback, Some(FallbackReason::PeekLimit));
}
