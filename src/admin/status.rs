//! The status page at the admin listener's `/`: one HTML file with its style and script inline,
//! which reads `/admin/peers` itself. It holds no data, so it is served without the token; its
//! requests carry the token the operator types in.

use std::sync::LazyLock;

use http::{Response, StatusCode};
use sha2::{Digest, Sha256};

const PAGE: &str = include_str!("status.html");

/// The page's content security policy: its own inline style and script only, by their hashes
/// (a nonce would need a fresh page per request, and the page never changes), requests to its
/// own origin only, and no framing, forms or base URL that an injected fragment could use.
static POLICY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; \
         img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
        source_hash(inline(PAGE, "script")),
        source_hash(inline(PAGE, "style")),
    )
});

/// The text between `<tag>` and `</tag>`, as the browser hashes it.
fn inline<'a>(page: &'a str, tag: &str) -> &'a str {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let start = page.find(&open).map_or(0, |at| at + open.len());
    let end = page[start..].find(&close).map_or(start, |at| start + at);
    &page[start..end]
}

fn source_hash(text: &str) -> String {
    format!("'sha256-{}'", base64(&Sha256::digest(text.as_bytes())))
}

/// Standard base64 with padding, for the policy's hashes.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

pub fn page() -> Response<Vec<u8>> {
    let body = PAGE.as_bytes().to_vec();
    Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "text/html; charset=utf-8")
        .header(http::header::CONTENT_LENGTH, body.len())
        .header(http::header::CONTENT_SECURITY_POLICY, POLICY.as_str())
        .header(http::header::X_FRAME_OPTIONS, "DENY")
        .header(http::header::CACHE_CONTROL, "no-store")
        .header(http::header::X_CONTENT_TYPE_OPTIONS, "nosniff")
        .header(http::header::REFERRER_POLICY, "no-referrer")
        .body(body)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_standard_vectors() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(plain.as_bytes()), encoded, "{plain}");
        }
    }

    #[test]
    fn the_policy_names_the_one_script_and_the_one_style() {
        assert_eq!(PAGE.matches("<script").count(), 1);
        assert_eq!(PAGE.matches("<style").count(), 1);
        let script = inline(PAGE, "script");
        assert!(script.contains("fetch('/admin/peers'"));
        assert!(inline(PAGE, "style").contains(".bar"));
        // The hash of the empty string would mean the script was not found.
        assert_ne!(source_hash(script), source_hash(""));
        assert!(POLICY.contains(&source_hash(script)));
        assert!(POLICY.starts_with("default-src 'none';"));
    }

    #[test]
    fn the_page_loads_nothing_from_elsewhere() {
        for outside in [
            "src=", "href=", "url(", "@import", "http://", "https://", "style=\"",
        ] {
            assert!(!PAGE.contains(outside), "the page holds {outside}");
        }
    }

    #[test]
    fn the_page_is_served_with_its_guards() {
        let r = page();
        let h = r.headers();
        assert_eq!(h["content-type"], "text/html; charset=utf-8");
        assert_eq!(h["x-frame-options"], "DENY");
        assert_eq!(h["cache-control"], "no-store");
        assert_eq!(h["content-security-policy"], POLICY.as_str());
        assert_eq!(r.body().len(), PAGE.len());
    }
}
