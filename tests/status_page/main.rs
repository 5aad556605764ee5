//! The status page at the admin listener's `/`, through the real binary: its HTML is served
//! without the token and with its guards; a drain call passes from the page's own origin with
//! the token and a JSON body and from nowhere else a browser could send it; and in headless
//! Chromium the page shows every peer with its load, keeps a screenshot, and drains a peer on a
//! click, while a page of another site cannot.
//!
//! The browser tests fail when no chromium is installed, unless `PREFIXLB_SKIP_BROWSER=1`.

mod cdp;
#[path = "../common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

const TOKEN: &str = "page-s3cret";

type Header<'a> = (&'a str, &'a str);

async fn listing(proxy: &Proxy, token: Option<&str>) -> Value {
    let mut r = client().get(format!("http://{}/admin/peers", proxy.admin));
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    r.send().await.unwrap().json().await.unwrap()
}

fn draining(listing: &Value, addr: &str) -> bool {
    let peers = listing["peers"].as_array().unwrap();
    let peer = peers.iter().find(|p| p["address"] == addr);
    peer.unwrap_or_else(|| panic!("{addr} not listed: {listing}"))["draining"] == true
}

/// Polls the listing until `addr`'s draining state is `want`, at most 5 s.
async fn until_draining(proxy: &Proxy, token: Option<&str>, addr: &str, want: bool) {
    let start = Instant::now();
    while draining(&listing(proxy, token).await, addr) != want {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{addr} draining is not {want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The status of a POST to `url` with a JSON-looking body and `headers`.
async fn post(url: &str, headers: &[Header<'_>]) -> u16 {
    let mut r = client().post(url).body("{}");
    for (name, value) in headers {
        r = r.header(*name, *value);
    }
    r.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_served_without_the_token_with_its_guards() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up]).admin_token(TOKEN)).await;
    let page = client()
        .get(format!("http://{}/", proxy.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), 200);
    let h = page.headers().clone();
    assert_eq!(h["content-type"], "text/html; charset=utf-8");
    assert_eq!(h["x-frame-options"], "DENY");
    assert_eq!(h["cache-control"], "no-store");
    let policy = h["content-security-policy"].to_str().unwrap();
    assert!(policy.starts_with("default-src 'none';"), "{policy}");
    assert!(policy.contains("script-src 'sha256-"), "{policy}");
    assert!(policy.contains("frame-ancestors 'none'"), "{policy}");
    let html = page.text().await.unwrap();
    assert!(html.contains("<title>prefixlb status</title>"));
    assert!(!html.contains(&up.addr_str()), "the shell holds figures");
    // The figures themselves need the token, as they always did.
    assert!(listing(&proxy, None).await["peers"].is_null());
    assert!(listing(&proxy, Some(TOKEN)).await["peers"].is_array());
    let other = format!("http://{}/", proxy.admin);
    assert_eq!(post(&other, &[]).await, 401, "only GET / is open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_call_passes_only_from_the_own_origin_with_the_token_and_json() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up]).admin_token(TOKEN)).await;
    let a = up.addr_str();
    let drain = format!("http://{}/admin/peers/{a}/drain", proxy.admin);
    let own = format!("http://{}", proxy.admin);
    let next_port = format!("http://127.0.0.1:{}", proxy.admin.port() + 1);
    let bearer = format!("Bearer {TOKEN}");
    let auth = ("authorization", bearer.as_str());
    let wrong = ("authorization", "Bearer nope");
    let json = ("content-type", "application/json");
    let form = ("content-type", "application/x-www-form-urlencoded");
    let text = ("content-type", "text/plain");
    let same = ("sec-fetch-site", "same-origin");
    let cross = ("sec-fetch-site", "cross-site");
    let ours = ("origin", own.as_str());
    let evil = ("origin", "http://evil.example");
    let opaque = ("origin", "null");
    let neighbour = ("origin", next_port.as_str());
    let refused: [(&str, &[Header], u16); 9] = [
        ("a foreign origin", &[evil, auth, json], 403),
        ("another port", &[neighbour, auth, json], 403),
        ("an opaque origin", &[opaque, auth, json], 403),
        ("a form body", &[ours, auth, form], 403),
        ("a text body", &[ours, auth, text], 403),
        ("no body type", &[ours, auth], 403),
        ("a cross-site fetch", &[ours, auth, json, cross], 403),
        ("no token", &[ours, json, same], 401),
        ("a wrong token", &[ours, json, same, wrong], 401),
    ];
    for (case, headers, status) in refused {
        assert_eq!(post(&drain, headers).await, status, "{case}");
    }
    assert!(
        !draining(&listing(&proxy, Some(TOKEN)).await, &a),
        "a refused call drained"
    );
    // What the page's own fetch sends.
    let page = [ours, auth, json, same];
    assert_eq!(post(&drain, &page).await, 200);
    assert!(draining(&listing(&proxy, Some(TOKEN)).await, &a));
    assert_eq!(post(&drain.replace("/drain", "/undrain"), &page).await, 200);
    assert!(!draining(&listing(&proxy, Some(TOKEN)).await, &a));
    // The preflight that a page of another site needs before a JSON POST gets no grant.
    let preflight = client()
        .request(reqwest::Method::OPTIONS, &drain)
        .header("origin", "http://evil.example")
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization,content-type",
        )
        .send()
        .await
        .unwrap();
    assert!(!preflight.status().is_success());
    assert!(preflight
        .headers()
        .get("access-control-allow-origin")
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_a_page_call_must_address_the_listener_by_ip_or_localhost() {
    let up = start_upstream("a").await;
    let proxy = start_proxy(&TestConfig::new().peers(&[&up])).await;
    let a = up.addr_str();
    let port = proxy.admin.port();
    let drain = format!("http://{}/admin/peers/{a}/drain", proxy.admin);
    let undrain = drain.replace("/drain", "/undrain");
    let json = ("content-type", "application/json");
    // A name its owner could point at this listener's address (DNS rebinding).
    let (name, name_origin) = (
        format!("rebound.example:{port}"),
        format!("http://rebound.example:{port}"),
    );
    let rebound = [
        ("host", name.as_str()),
        ("origin", name_origin.as_str()),
        json,
    ];
    assert_eq!(post(&drain, &rebound).await, 403);
    let foreign = [("origin", "http://evil.example"), json];
    assert_eq!(post(&drain, &foreign).await, 403);
    assert!(!draining(&listing(&proxy, None).await, &a));
    let (local, local_origin) = (
        format!("localhost:{port}"),
        format!("http://localhost:{port}"),
    );
    let page = [
        ("host", local.as_str()),
        ("origin", local_origin.as_str()),
        json,
    ];
    assert_eq!(post(&drain, &page).await, 200);
    let own = format!("http://{}", proxy.admin);
    assert_eq!(post(&undrain, &[("origin", own.as_str()), json]).await, 200);
    // A tool's plain POST, as before.
    assert_eq!(post(&drain, &[]).await, 200);
    assert!(draining(&listing(&proxy, None).await, &a));
}

/// The number in `data-in-flight` of `addr`'s row in `dom`.
fn shown_in_flight(dom: &str, addr: &str) -> Option<u64> {
    let row = &dom[dom.find(&format!("data-peer=\"{addr}\""))?..];
    let tail = &row[row.find("data-in-flight=\"")? + "data-in-flight=\"".len()..];
    tail[..tail.find('"')?].parse().ok()
}

/// The text of the element with `id` (no nested elements).
fn text_of<'a>(dom: &'a str, id: &str) -> &'a str {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no #{id}"));
    let start = at + dom[at..].find('>').unwrap() + 1;
    &dom[start..start + dom[start..].find('<').unwrap()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_every_peer_and_its_load() {
    let Some(chromium) = cdp::browser() else {
        return;
    };
    let ups = upstreams::<3>().await;
    let config = TestConfig::new()
        .peers(&ups)
        .max_in_flight(4)
        .admin_token(TOKEN)
        .engine_metrics(true)
        .engine_metrics_interval_ms(200);
    let proxy = start_proxy(&config).await;
    // Two streams that last the test (20 s): one peer at least carries one.
    let streams = [
        open_stream(&proxy, 400, 50).await,
        open_stream(&proxy, 400, 50).await,
    ];
    let before = listing(&proxy, Some(TOKEN)).await;
    let carried: Vec<(String, u64)> = before["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["address"].as_str().unwrap().to_owned(),
                p["in_flight"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(carried.iter().map(|(_, n)| n).sum::<u64>(), 2, "{before}");

    let url = format!("http://{}/#token={TOKEN}", proxy.admin);
    let dom = cdp::dump_dom(&chromium, &url, 5000).await;
    assert_eq!(carried.len(), ups.len());
    for (addr, in_flight) in &carried {
        let shown =
            shown_in_flight(&dom, addr).unwrap_or_else(|| panic!("{addr} not shown: {dom}"));
        assert_eq!(shown, *in_flight, "{addr}'s requests in flight");
    }
    let total: u64 = text_of(&dom, "total-in-flight").parse().unwrap();
    assert_eq!(total, 2, "the total in flight");
    assert!(
        text_of(&dom, "status").starts_with("Updated"),
        "{}",
        text_of(&dom, "status")
    );
    assert!(dom.contains(" s old<"), "no engine figures shown");

    // Without the token the page gets no figures, and says why.
    let bare = cdp::dump_dom(&chromium, &format!("http://{}/", proxy.admin), 3000).await;
    assert!(
        !bare.contains("data-peer="),
        "figures shown without the token"
    );
    assert!(text_of(&bare, "status").contains("wants its token"));

    let png = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    let _ = std::fs::remove_file(&png);
    cdp::screenshot(&chromium, &url, 5000, &png, (1280, 900)).await;
    let bytes = std::fs::read(&png).expect("no screenshot");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    let size = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    assert_eq!(
        (size(16), size(20)),
        (1280, 900),
        "the PNG's width and height"
    );
    // A blank page compresses to a few hundred bytes; a table of text does not.
    assert!(bytes.len() > 10_000, "a {} byte screenshot", bytes.len());
    eprintln!("screenshot: {}", png.display());
    drop(streams);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_drains_and_undrains_a_peer_in_a_browser() {
    let Some(chromium) = cdp::browser() else {
        return;
    };
    let ups = upstreams::<2>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups).admin_token(TOKEN)).await;
    let mut browser = cdp::Browser::launch(&chromium).await;
    browser
        .navigate(&format!("http://{}/#token={TOKEN}", proxy.admin))
        .await;
    let rows = "document.querySelectorAll('tr[data-peer]').length === 2";
    browser.wait_for(rows, Duration::from_secs(15)).await;
    assert_eq!(
        browser.eval("location.hash").await,
        "",
        "the token stayed in the URL"
    );
    let kept = browser
        .eval("sessionStorage.getItem('prefixlb-admin-token')")
        .await;
    assert_eq!(kept, TOKEN);

    let a = ups[1].addr_str();
    let button = format!("document.querySelector('tr[data-peer=\"{a}\"] button.action')");
    for (label, want) in [("Drain", true), ("Undrain", false)] {
        let shown = format!("{button}.textContent === '{label}' && !{button}.disabled");
        browser.wait_for(&shown, Duration::from_secs(5)).await;
        browser.eval(&format!("{button}.click(), true")).await;
        until_draining(&proxy, Some(TOKEN), &a, want).await;
    }
    let status = browser
        .eval("document.getElementById('status').className")
        .await;
    assert_eq!(status, "", "the page reported an error");
}

/// A page of another origin (another port) for the browser to run a cross-site attempt from.
async fn elsewhere() -> std::net::SocketAddr {
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(|| async {
            axum::response::Html("<!DOCTYPE html><title>elsewhere</title>")
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Every way a page can make a browser POST to `url` without a CORS grant: a JSON fetch (which
/// needs a preflight), `no-cors` fetches with a text body and with none, and a form.
const ATTEMPTS: &str = r#"(async (url) => {
  const out = {};
  try {
    await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{}' });
    out.json = 'sent';
  } catch (e) { out.json = 'blocked'; }
  const text = await fetch(url, { method: 'POST', mode: 'no-cors', headers: { 'content-type': 'text/plain' }, body: '{}' });
  out.text = text.type;
  const bare = await fetch(url, { method: 'POST', mode: 'no-cors' });
  out.bare = bare.type;
  const frame = document.createElement('iframe');
  frame.name = 'sink';
  document.body.append(frame);
  const form = document.createElement('form');
  form.method = 'post';
  form.action = url;
  form.target = 'sink';
  document.body.append(form);
  const loaded = new Promise((resolve) => frame.addEventListener('load', resolve, { once: true }));
  form.submit();
  await Promise.race([loaded, new Promise((resolve) => setTimeout(resolve, 5000))]);
  out.form = 'submitted';
  return out;
})"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_another_site_cannot_drain_in_a_browser() {
    let Some(chromium) = cdp::browser() else {
        return;
    };
    // No token: the Origin rule is all that stands between a page and the API.
    let ups = upstreams::<2>().await;
    let proxy = start_proxy(&TestConfig::new().peers(&ups)).await;
    let a = ups[0].addr_str();
    let drain = format!("http://{}/admin/peers/{a}/drain", proxy.admin);
    let mut browser = cdp::Browser::launch(&chromium).await;
    browser
        .navigate(&format!("http://{}/", elsewhere().await))
        .await;
    browser
        .wait_for("document.title === 'elsewhere'", Duration::from_secs(10))
        .await;
    let out = browser.eval(&format!("{ATTEMPTS}('{drain}')")).await;
    assert_eq!(out["json"], "blocked", "{out}");
    assert_eq!(out["text"], "opaque", "{out}");
    assert_eq!(out["bare"], "opaque", "{out}");
    assert_eq!(out["form"], "submitted", "{out}");
    assert!(
        !draining(&listing(&proxy, None).await, &a),
        "a page of another site drained a peer: {out}"
    );

    // The same browser drains from the status page itself: what stopped the others was
    // where they came from.
    browser.navigate(&format!("http://{}/", proxy.admin)).await;
    let button = format!("document.querySelector('tr[data-peer=\"{a}\"] button.action')");
    let ready = format!("{button} !== null && {button}.textContent === 'Drain'");
    browser.wait_for(&ready, Duration::from_secs(15)).await;
    browser.eval(&format!("{button}.click(), true")).await;
    until_draining(&proxy, None, &a, true).await;
}
