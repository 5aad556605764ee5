//! Where a key comes from besides the body (a session header, the client's address), and the
//! reason each kind of body that yields no key falls back for, the peek limit's included.

use http::HeaderValue;

use super::*;

#[test]
fn session_header_wins_and_other_routes_fall_back() {
    let mut headers = HeaderMap::new();
    headers.insert("x-session-id", HeaderValue::from_static("conv-1"));
    let ex = extractor();
    let with_header = |body: &[u8]| {
        ex.key_for(&RequestParts {
            method: &Method::POST,
            path: CHAT,
            headers: &headers,
            client: None,
            body,
            end: BodyEnd::More,
        })
    };
    let Extract::Key(k) = with_header(b"") else {
        panic!("a session header needs no body")
    };
    assert_eq!(k.source, KeySource::SessionHeader);
    assert_eq!(with_header(b"{\"model\":"), Extract::Key(k));
    assert_eq!(ex.body_kind(&Method::POST, CHAT, &headers), None);
    assert_eq!(
        ex.body_kind(&Method::POST, CHAT, &HeaderMap::new()),
        Some(BodyKind::Chat)
    );
    assert_eq!(ex.body_kind(&Method::GET, CHAT, &HeaderMap::new()), None);

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
