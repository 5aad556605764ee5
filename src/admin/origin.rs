//! Which state-changing admin calls a web page could have made a browser send, and which of
//! those came from the admin listener's own status page.
//!
//! Browsers put an `Origin` header on every POST a page makes, same-origin ones included, so
//! "no Origin" alone would refuse the status page's own drain button. A POST that carries an
//! `Origin` is taken only when all of these hold:
//!
//! - the Origin is this listener as the browser addressed it: `http://` (or `https://`, a TLS
//!   front on the same authority) followed by exactly the request's `Host`. Only a page served
//!   from that authority has that Origin, and the only page served there is the status page;
//! - the body is `application/json`. A page of another site can send that only after a CORS
//!   preflight (`OPTIONS`), which the API never answers with CORS headers, so the browser never
//!   sends the POST;
//! - the bearer token was checked (the caller has already been refused without it), or, with
//!   no `admin.token` set, the `Host` is an IP address or `localhost`. A DNS name could be
//!   rebound by its owner to this listener's address, making their page "same-origin" with
//!   it; they cannot do that to an address literal, and without a token the listener is on
//!   loopback.
//!
//! A request without `Origin` (curl, scripts) is taken as before, unless its body is of a type
//! an HTML form or a CORS-free `fetch` sends, or the browser's `Sec-Fetch-Site` says it came
//! from another site.

use std::net::{IpAddr, Ipv6Addr};

use http::HeaderMap;

/// Why a POST is refused as one a page of another site could have sent; `None`: it is taken.
/// `token_checked`: an admin token is set, and this request carried it.
pub fn refusal(headers: &HeaderMap, token_checked: bool) -> Option<&'static str> {
    let mime = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        });
    let simple_body = mime.as_deref().is_some_and(|m| {
        matches!(
            m,
            "application/x-www-form-urlencoded" | "multipart/form-data" | "text/plain"
        )
    });
    if simple_body {
        return Some("a form or text body, which a page of any site can send");
    }
    let fetch_site = headers
        .get("sec-fetch-site")
        .map(|v| v.as_bytes().to_ascii_lowercase());
    if fetch_site.is_some_and(|s| s != b"same-origin" && s != b"none") {
        return Some("the browser says a page of another site sent it (Sec-Fetch-Site)");
    }
    let mut origins = headers.get_all(http::header::ORIGIN).iter();
    // Without an Origin it is a tool's call, not a browser's: taken.
    let origin = origins.next()?;
    if origins.next().is_some() {
        return Some("more than one Origin");
    }
    let host = headers
        .get(http::header::HOST)
        .and_then(|v| v.to_str().ok());
    let authority = origin.to_str().ok().and_then(|o| {
        o.strip_prefix("http://")
            .or_else(|| o.strip_prefix("https://"))
    });
    let own = match (authority, host) {
        (Some(a), Some(h)) => !a.is_empty() && a.eq_ignore_ascii_case(h),
        _ => false,
    };
    if !own {
        return Some("an Origin other than this listener's own");
    }
    if mime.as_deref() != Some("application/json") {
        return Some("a page's call must have a JSON body (content-type: application/json)");
    }
    if !token_checked && !authority.is_some_and(is_address_literal) {
        return Some(
            "without admin.token, a page's call is taken only at an IP address or localhost",
        );
    }
    None
}

/// Whether a request's `Host` is a name (not an address literal or `localhost`): with no admin
/// token, a page of the name's owner could have had the browser rebind it to this listener,
/// and read what it answers as its own. A request without `Host` (HTTP/1.0) is no browser's.
pub fn host_rebindable(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::HOST)
        .is_some_and(|h| !h.to_str().is_ok_and(is_address_literal))
}

/// Whether `authority`'s host is one no DNS answer decides: an IP address or `localhost`.
fn is_address_literal(authority: &str) -> bool {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest
            .split_once(']')
            .is_some_and(|(ip, _)| ip.parse::<Ipv6Addr>().is_ok());
    }
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_named_host_is_rebindable() {
        for host in [
            "127.0.0.1:9090",
            "[::1]:9090",
            "localhost:9090",
            "LOCALHOST",
            "10.0.0.1",
        ] {
            assert!(!host_rebindable(&headers(&[("host", host)])), "{host}");
        }
        for host in [
            "evil.example:9090",
            "localhost.evil.example",
            "127.0.0.1.nip.io:9090",
        ] {
            assert!(host_rebindable(&headers(&[("host", host)])), "{host}");
        }
        assert!(!host_rebindable(&HeaderMap::new()));
    }

    const OWN: &[(&str, &str)] = &[
        ("host", "127.0.0.1:9090"),
        ("origin", "http://127.0.0.1:9090"),
        ("content-type", "application/json"),
        ("sec-fetch-site", "same-origin"),
    ];

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    /// `OWN` with `name` set to `value` (or removed, for `None`).
    fn with(name: &str, value: Option<&str>) -> HeaderMap {
        let mut pairs: Vec<(&str, &str)> =
            OWN.iter().copied().filter(|(n, _)| *n != name).collect();
        if let Some(v) = value {
            pairs.push((name, v));
        }
        headers(&pairs)
    }

    #[test]
    fn the_status_page_own_call_is_taken() {
        assert_eq!(refusal(&headers(OWN), true), None);
        assert_eq!(refusal(&headers(OWN), false), None);
        let charset = with("content-type", Some("Application/JSON; charset=utf-8"));
        assert_eq!(refusal(&charset, true), None);
        for (host, origin) in [
            ("localhost:9090", "http://LOCALHOST:9090"),
            ("[::1]:9090", "http://[::1]:9090"),
        ] {
            let h = headers(&[
                ("host", host),
                ("origin", origin),
                ("content-type", "application/json"),
            ]);
            assert_eq!(refusal(&h, false), None, "{origin}");
        }
    }

    #[test]
    fn a_tool_without_origin_is_taken() {
        assert_eq!(
            refusal(&headers(&[("host", "127.0.0.1:9090")]), false),
            None
        );
        let json = headers(&[("content-type", "application/json")]);
        assert_eq!(refusal(&json, true), None);
    }

    #[test]
    fn other_origins_are_refused() {
        for origin in [
            "http://evil.example",
            "http://127.0.0.1:9091",
            "http://127.0.0.1",
            "null",
            "http://127.0.0.1:9090.evil.example",
            "ftp://127.0.0.1:9090",
            "",
        ] {
            assert!(
                refusal(&with("origin", Some(origin)), true).is_some(),
                "{origin}"
            );
        }
        assert!(refusal(&with("host", None), true).is_some(), "no Host");
        let mut twice = headers(OWN);
        twice.append(http::header::ORIGIN, "http://evil.example".parse().unwrap());
        assert!(refusal(&twice, true).is_some(), "two Origins");
    }

    #[test]
    fn form_and_text_bodies_are_refused_even_from_the_own_origin() {
        for mime in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ] {
            let h = with("content-type", Some(mime));
            assert!(refusal(&h, true).is_some(), "{mime}");
            let no_origin = headers(&[("content-type", mime)]);
            assert!(refusal(&no_origin, true).is_some(), "{mime} without Origin");
        }
        let none = with("content-type", None);
        assert!(
            refusal(&none, true).is_some(),
            "a page's call without a body type"
        );
    }

    #[test]
    fn a_cross_site_fetch_is_refused_by_its_fetch_metadata() {
        for site in ["cross-site", "same-site"] {
            assert!(refusal(&with("sec-fetch-site", Some(site)), true).is_some());
            let bare = headers(&[("sec-fetch-site", site)]);
            assert!(refusal(&bare, true).is_some(), "{site} without Origin");
        }
    }

    #[test]
    fn a_rebindable_name_needs_the_token() {
        let h = headers(&[
            ("host", "admin.example:9090"),
            ("origin", "http://admin.example:9090"),
            ("content-type", "application/json"),
        ]);
        assert!(refusal(&h, false).is_some());
        assert_eq!(refusal(&h, true), None);
    }

    #[test]
    fn address_literals() {
        for yes in [
            "127.0.0.1:9090",
            "127.0.0.1",
            "[::1]:9090",
            "localhost:1",
            "10.1.2.3:80",
        ] {
            assert!(is_address_literal(yes), "{yes}");
        }
        for no in [
            "admin.example:9090",
            "[evil]:9090",
            "localhost.evil:9090",
            "127.0.0.1.nip.io:1",
        ] {
            assert!(!is_address_literal(no), "{no}");
        }
    }
}
