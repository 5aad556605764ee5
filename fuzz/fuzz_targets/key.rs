//! The key extractor on any body, cut anywhere: it never panics, and a key it calls complete on
//! part of a body is the key of the whole body and of every longer part. "The key" is what
//! routes: the hash and its source. The reason a broken body falls back is a diagnostic, the
//! first error the parser met in the bytes it had, and may differ with more bytes.
#![no_main]

use http::{HeaderMap, Method};
use libfuzzer_sys::fuzz_target;
use prefixlb::routing::{BodyEnd, Extract, KeyConfig, KeyExtractor, RequestParts, RoutingKey};

fuzz_target!(|input: &[u8]| {
    let Some((&selector, rest)) = input.split_first() else {
        return;
    };
    let Some((&cut, body)) = rest.split_first() else {
        return;
    };
    let config = KeyConfig::default();
    let path = match selector % 3 {
        0 => config.chat_path.clone(),
        1 => config.completions_path.clone(),
        _ => config.generate_path.clone(),
    }
    .unwrap();
    let keys = KeyExtractor::new(config);
    let headers = HeaderMap::new();
    let client = Some("192.0.2.1".parse().unwrap());
    let key = |body: &[u8], end| {
        let routes = |k: RoutingKey| (k.hash, k.source);
        match keys.key_for(&RequestParts {
            method: &Method::POST,
            path: &path,
            headers: &headers,
            client,
            body,
            end,
        }) {
            Extract::Key(k) | Extract::Deeper(k) => Some(routes(k)),
            Extract::NeedMore => None,
        }
    };
    let whole = key(body, BodyEnd::Complete);
    assert!(whole.is_some(), "a complete body always has a key");
    let at = (cut as usize * body.len()) / 255;
    let part = &body[..at];
    assert!(key(part, BodyEnd::Limit).is_some());
    if let Some(early) = key(part, BodyEnd::More) {
        assert_eq!(whole, Some(early), "the whole body changed a complete key");
        assert_eq!(key(part, BodyEnd::Limit), Some(early));
        let longer = &body[..(at + 1 + body.len()) / 2];
        assert_eq!(key(longer, BodyEnd::More), Some(early));
    }
});
