//! Kubernetes discovery against an API server of the tests' own (plain HTTP on loopback):
//! the peers of a Service's EndpointSlices through the real binary's admin API, as the first
//! list gives them, as watch events change them, and across a watch that breaks or expires;
//! the source itself in process; and the configuration's checks.

mod common;

#[path = "kubernetes/api_server.rs"]
mod api_server;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use api_server::{ApiServer, SERVICES, SLICES};
use common::dns::upstreams_on_one_port;
use common::*;
use prefixlb::control::discovery::kubernetes::KubernetesSource;
use prefixlb::control::discovery::source::PeerSource;
use prefixlb::settings::{Discovery, KubePort, KubeSelect};
use serde_json::{json, Value};

const NS: &str = "inference";

/// An endpoint: its address and conditions (`null` for none given).
fn endpoint(ip: &str, conditions: Value) -> Value {
    json!({"addresses": [ip], "conditions": conditions})
}

fn ready(ip: &str) -> Value {
    endpoint(
        ip,
        json!({"ready": true, "serving": true, "terminating": false}),
    )
}

fn unready(ip: &str) -> Value {
    endpoint(
        ip,
        json!({"ready": false, "serving": false, "terminating": false}),
    )
}

/// An EndpointSlice of `service`, with `ports` as `(name, number)` and these annotations.
fn slice(name: &str, service: &str, ports: &[(&str, u16)], eps: &[Value], notes: Value) -> Value {
    let ports: Vec<Value> = ports
        .iter()
        .map(|(name, port)| json!({"name": name, "port": port, "protocol": "TCP"}))
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "annotations": notes,
            "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4", "endpoints": eps, "ports": ports})
}

fn service(name: &str, notes: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS, "annotations": notes},
        "spec": {"ports": [{"name": "http", "port": 80}]}})
}

/// The API server's token, in a file as a service account's is.
fn token_file(api: &ApiServer) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), api.token()).unwrap();
    file
}

/// `(address, weight, max_in_flight)` of every listed peer, by address.
fn listed(l: &Value) -> Vec<(String, u64, Option<u64>)> {
    let mut v: Vec<_> = l["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let address = p["address"].as_str().unwrap().to_owned();
            (
                address,
                p["weight"].as_u64().unwrap(),
                p["max_in_flight"].as_u64(),
            )
        })
        .collect();
    v.sort();
    v
}

/// Polls the admin listing until it is `want`, at most 5 s.
async fn until_listed(proxy: &Proxy, want: &[(&Upstream, u64, Option<u64>)]) {
    let mut want: Vec<_> = want
        .iter()
        .map(|(u, w, m)| (u.addr_str(), *w, *m))
        .collect();
    want.sort();
    let start = Instant::now();
    loop {
        let now = listed(&proxy.peers().await);
        if now == want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "listed {now:?}, not {want:?}\n{}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `done` holds, at most 5 s.
async fn until(what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "not {what} in 5 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn ip(u: &Upstream) -> String {
    u.addr.ip().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_list_gives_the_ready_endpoints_of_the_service_with_annotated_terms() {
    let (port, [a, b, c, d]) = upstreams_on_one_port::<4>().await;
    let api = ApiServer::start().await;
    let notes = json!({"prefixlb.io/weight": "3", "prefixlb.io/max-in-flight": "8"});
    api.apply(SERVICES, service("vllm", notes));
    let ports = [("metrics", 9090), ("http", port)];
    // Not known to be unready counts as ready; unready and terminating endpoints do not.
    let eps = [ready(&ip(&a)), unready(&ip(&b))];
    api.apply(SLICES, slice("vllm-1", "vllm", &ports, &eps, json!({})));
    let terminating = endpoint(&ip(&d), json!({"ready": true, "terminating": true}));
    let eps = [endpoint(&ip(&c), Value::Null), terminating];
    let heavier = json!({"prefixlb.io/weight": "5"});
    api.apply(SLICES, slice("vllm-2", "vllm", &ports, &eps, heavier));
    // Another Service's slice is not asked for.
    let other = [ready(&ip(&b))];
    api.apply(SLICES, slice("other-1", "other", &ports, &other, json!({})));

    let tokens = token_file(&api);
    let cfg = TestConfig::new()
        .kubernetes(&api.url, tokens.path(), NS, "vllm")
        .kubernetes_port("http");
    let proxy = start_proxy(&cfg).await;
    until_listed(&proxy, &[(&a, 3, Some(8)), (&c, 5, Some(8))]).await;

    let slices = &api.queries(SLICES)[0];
    assert_eq!(slices["labelSelector"], "kubernetes.io/service-name=vllm");
    assert_eq!(
        api.queries(SERVICES)[0]["fieldSelector"],
        "metadata.name=vllm"
    );
    let (c_, url) = (client(), proxy.url("/v1/chat/completions"));
    for i in 0..20 {
        let body = chat("sys", &format!("conversation {i}"), 1, false);
        let r = c_.post(&url).body(body).send().await.unwrap();
        assert_eq!(r.status(), 200, "{}", proxy.log());
        let upstream = r.headers()["x-upstream"].to_str().unwrap().to_owned();
        assert!(upstream == "a" || upstream == "c", "served by {upstream}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_events_add_ready_endpoints_drop_unready_ones_and_change_the_terms() {
    let (port, [a, b, c]) = upstreams_on_one_port::<3>().await;
    let api = ApiServer::start().await;
    api.apply(SERVICES, service("vllm", json!({})));
    let ports = [("http", port)];
    let eps = [ready(&ip(&a)), ready(&ip(&b))];
    api.apply(SLICES, slice("vllm-1", "vllm", &ports, &eps, json!({})));
    let tokens = token_file(&api);
    // No port named: the slice's only one.
    let cfg = TestConfig::new().kubernetes(&api.url, tokens.path(), NS, "vllm");
    let proxy = start_proxy(&cfg).await;
    until_listed(&proxy, &[(&a, 1, None), (&b, 1, None)]).await;

    let eps = [ready(&ip(&a)), unready(&ip(&b)), ready(&ip(&c))];
    api.apply(SLICES, slice("vllm-1", "vllm", &ports, &eps, json!({})));
    until_listed(&proxy, &[(&a, 1, None), (&c, 1, None)]).await;

    api.apply(
        SERVICES,
        service("vllm", json!({"prefixlb.io/weight": "4"})),
    );
    until_listed(&proxy, &[(&a, 4, None), (&c, 4, None)]).await;
    let capped = json!({"prefixlb.io/max-in-flight": "2"});
    api.apply(SLICES, slice("vllm-1", "vllm", &ports, &eps, capped));
    until_listed(&proxy, &[(&a, 4, Some(2)), (&c, 4, Some(2))]).await;

    let second = [ready(&ip(&b))];
    api.apply(SLICES, slice("vllm-2", "vllm", &ports, &second, json!({})));
    until_listed(&proxy, &[(&a, 4, Some(2)), (&b, 4, None), (&c, 4, Some(2))]).await;
    api.delete(SLICES, "vllm-2");
    until_listed(&proxy, &[(&a, 4, Some(2)), (&c, 4, Some(2))]).await;
    // The process's first list was on its start-up runtime, the second the control plane's;
    // every change since came down the watch.
    assert_eq!(api.lists(SLICES), 2, "{}", proxy.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_watch_resumes_and_an_expired_one_lists_again_keeping_the_peers() {
    let (port, [a, b, c, d]) = upstreams_on_one_port::<4>().await;
    let api = ApiServer::start().await;
    api.apply(SERVICES, service("vllm", json!({})));
    let ports = [("http", port)];
    let with = |eps: &[&Upstream]| {
        let eps: Vec<Value> = eps.iter().map(|u| ready(&ip(u))).collect();
        slice("vllm-1", "vllm", &ports, &eps, json!({}))
    };
    api.apply(SLICES, with(&[&a, &b]));
    let tokens = token_file(&api);
    let cfg = TestConfig::new().kubernetes(&api.url, tokens.path(), NS, "vllm");
    let proxy = start_proxy(&cfg).await;
    until_listed(&proxy, &[(&a, 1, None), (&b, 1, None)]).await;
    // Listed at start-up, then by the control plane, which watches since.
    until("watching", || {
        api.lists(SLICES) == 2 && api.watching(SLICES) == 1
    })
    .await;
    let lists = api.lists(SLICES);

    // `a` stays in every version: it must stay listed throughout.
    let done = Arc::new(AtomicBool::new(false));
    let admin = proxy.admin;
    let a_addr = a.addr_str();
    let watcher = tokio::spawn({
        let done = Arc::clone(&done);
        async move {
            while !done.load(Ordering::SeqCst) {
                let l = reqwest::get(format!("http://{admin}/admin/peers"))
                    .await
                    .unwrap();
                let l: Value = l.json().await.unwrap();
                let now = listed(&l);
                assert!(now.iter().any(|p| p.0 == a_addr), "a was dropped: {now:?}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });

    // A watch that ran a while and is cut resumes from its version: no list again.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    api.cut_watches();
    api.apply(SLICES, with(&[&a, &b, &c]));
    until_listed(&proxy, &[(&a, 1, None), (&b, 1, None), (&c, 1, None)]).await;
    assert_eq!(api.lists(SLICES), lists, "a resumed watch listed again");

    // A version the server forgot: an ERROR event 410, then an HTTP 410; a list each time.
    api.expire_with(false, &[(SLICES, with(&[&a, &b, &d]))]);
    until_listed(&proxy, &[(&a, 1, None), (&b, 1, None), (&d, 1, None)]).await;
    assert_eq!(api.lists(SLICES), lists + 1);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    api.expire_with(true, &[(SLICES, with(&[&a, &d]))]);
    until_listed(&proxy, &[(&a, 1, None), (&d, 1, None)]).await;
    assert_eq!(api.lists(SLICES), lists + 2);

    done.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
}

/// The source in process, through a kubeconfig: the first call waits for the lists, later
/// ones say only what changed, and a source disconnected (its runtime gone) starts afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_source_tells_each_change_once_and_starts_again_after_a_disconnect() {
    let api = ApiServer::start().await;
    api.apply(SERVICES, service("vllm", json!({})));
    let ports = [("http", 8000)];
    let eps = [ready("10.0.0.1")];
    api.apply(SLICES, slice("vllm-1", "vllm", &ports, &eps, json!({})));
    // Through a kubeconfig this time, whose context gives the namespace.
    let kubeconfig = tempfile::NamedTempFile::new().unwrap();
    let contents = json!({"apiVersion": "v1", "kind": "Config", "current-context": "mock",
        "clusters": [{"name": "mock", "cluster": {"server": api.url}}],
        "users": [{"name": "test", "user": {"token": api.token()}}],
        "contexts": [{"name": "mock", "context": {"cluster": "mock", "user": "test", "namespace": NS}}]});
    std::fs::write(kubeconfig.path(), contents.to_string()).unwrap();
    let path = kubeconfig.path().display();
    let yaml = format!("discovery: {{kubernetes: {{kubeconfig: '{path}', service: vllm}}}}");
    let settings = prefixlb::config::parse(&yaml).unwrap();
    let Discovery::Kubernetes(k) = &settings.discovery else {
        panic!("{:?}", settings.discovery)
    };
    let mut source = KubernetesSource::new(k).unwrap();
    let addrs = |peers: Option<Vec<prefixlb::routing::PeerSpec>>| -> Vec<String> {
        let peers = peers.expect("peers");
        peers.iter().map(|p| p.addr.to_string()).collect()
    };
    assert_eq!(addrs(source.peers(false).await.unwrap()), ["10.0.0.1:8000"]);
    assert_eq!(source.peers(false).await.unwrap(), None);
    assert!(source.peers(true).await.unwrap().is_some(), "forced");

    let eps = [ready("10.0.0.1"), ready("10.0.0.2")];
    api.apply(SLICES, slice("vllm-1", "vllm", &ports, &eps, json!({})));
    let start = Instant::now();
    let changed = loop {
        if let Some(peers) = source.peers(false).await.unwrap() {
            break peers;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "no change seen");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(addrs(Some(changed)), ["10.0.0.1:8000", "10.0.0.2:8000"]);

    source.disconnect();
    until("unwatched", || api.watching(SLICES) == 0).await;
    assert_eq!(addrs(source.peers(false).await.unwrap()).len(), 2);
    assert_eq!(api.lists(SLICES), 2);
}

#[test]
fn the_configuration_is_checked_naming_the_field() {
    let base = "discovery: {kubernetes: {api_server: 'http://127.0.0.1:1'";
    let error = |rest: &str| {
        let yaml = format!("{base}{rest}}}}}");
        prefixlb::config::parse(&yaml).unwrap_err().field
    };
    let f = |k: &str| format!("discovery.kubernetes.{k}");
    assert_eq!(error(""), f("service"));
    assert_eq!(error(", service: a, selector: 'app=b'"), f("selector"));
    assert_eq!(error(", service: a, port: 0"), f("port"));
    assert_eq!(error(", service: a, weight: 101"), f("weight"));
    assert_eq!(error(", service: a, context: c"), f("context"));
    assert_eq!(error(", service: a, kubeconfig: /k"), f("api_server"));
    let yaml = "discovery: {kubernetes: {service: a, token_file: /t}}";
    assert_eq!(
        prefixlb::config::parse(yaml).unwrap_err().field,
        f("token_file")
    );
    let yaml = "discovery: {kubernetes: {service: a, api_server: 'ftp://x'}}";
    assert_eq!(
        prefixlb::config::parse(yaml).unwrap_err().field,
        f("api_server")
    );
    let yaml = "discovery: {kubernetes: {service: a}, dns: {name: x, port: 1}}";
    assert_eq!(
        prefixlb::config::parse(yaml).unwrap_err().field,
        "discovery"
    );

    let port = |p: &str| {
        let yaml = format!("{base}, service: a, port: {p}}}}}");
        match prefixlb::config::parse(&yaml).unwrap().discovery {
            Discovery::Kubernetes(k) => k.port,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(port("http"), Some(KubePort::Name("http".into())));
    assert_eq!(port("8000"), Some(KubePort::Number(8000)));
    assert_eq!(port("'8000'"), Some(KubePort::Number(8000)));
}

/// Outside a pod, the default (the pod's service account) cannot work: said at start.
#[test]
fn without_a_pod_or_a_kubeconfig_the_source_is_refused() {
    if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        return;
    }
    let settings = prefixlb::config::parse("discovery: {kubernetes: {service: a}}").unwrap();
    let e = prefixlb::control::discovery::build(&settings.discovery, "/x.yaml".as_ref())
        .err()
        .expect("refused");
    assert!(e.reason.contains("kubeconfig"), "{e}");
}

/// The example manifests hold a configuration that reads, and grant what discovery reads.
#[test]
fn the_example_manifests_configure_discovery_and_grant_what_it_reads() {
    use serde::Deserialize;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("conf/kubernetes");
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    let map: serde_yaml::Value = serde_yaml::from_str(&read("20-configmap.yaml")).unwrap();
    let file = map["data"]["prefixlb.yaml"].as_str().unwrap();
    let Discovery::Kubernetes(k) = prefixlb::config::parse(file).unwrap().discovery else {
        panic!("not kubernetes discovery")
    };
    assert_eq!(k.select, KubeSelect::Service("vllm".into()));
    assert_eq!(k.port, Some(KubePort::Name("http".into())));

    let rbac = read("10-rbac.yaml");
    let role = serde_yaml::Deserializer::from_str(&rbac)
        .map(|doc| serde_yaml::Value::deserialize(doc).unwrap())
        .find(|doc| doc["kind"] == "Role")
        .unwrap();
    for (group, resource) in [("discovery.k8s.io", "endpointslices"), ("", "services")] {
        let rules = role["rules"].as_sequence().unwrap();
        let rule = rules
            .iter()
            .find(|r| r["resources"][0] == resource)
            .unwrap();
        assert_eq!(rule["apiGroups"][0], group);
        let verbs: serde_yaml::Value = serde_yaml::from_str("[get, list, watch]").unwrap();
        assert_eq!(rule["verbs"], verbs, "{resource}");
    }
}
