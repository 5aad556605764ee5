//! The declared body length the peek plans by, on any `Content-Length` values: it must be the
//! length Pingora frames the body by (one value, or identical ones, digits only), or none.
#![no_main]

use http::header::CONTENT_LENGTH;
use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use prefixlb::proxy::peek::declared_length;

fuzz_target!(|input: &[u8]| {
    let mut headers = HeaderMap::new();
    for line in input.split(|&b| b == b'\n') {
        if let Ok(v) = HeaderValue::from_bytes(line) {
            headers.append(CONTENT_LENGTH, v);
        }
    }
    let mut parts = Vec::new();
    let mut readable = true;
    for v in headers.get_all(CONTENT_LENGTH) {
        match v.to_str() {
            Ok(s) => parts.extend(s.split(',').map(|p| p.trim().to_owned())),
            Err(_) => readable = false,
        }
    }
    let numbers: Option<Vec<u64>> = parts
        .iter()
        .map(|p| {
            (!p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
                .then(|| p.parse::<u64>().ok())
                .flatten()
        })
        .collect();
    let framing = match numbers {
        Some(n) if readable && !n.is_empty() && n.iter().all(|&x| x == n[0]) => {
            usize::try_from(n[0]).ok()
        }
        _ => None,
    };
    assert_eq!(declared_length(&headers), framing, "{parts:?}");
});
