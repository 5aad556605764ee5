//! A Kubernetes API server of the tests' own, on loopback over plain HTTP: EndpointSlices and
//! Services of one namespace, listed and watched as the real one serves them (a list's
//! resourceVersion, watch streams of newline-delimited events from a version, 410 Gone for a
//! version it no longer keeps), with a bearer token required. The tests change the objects,
//! cut the watches, or expire the versions, and count the lists.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{json, Value};
use tokio::sync::mpsc;

pub const SLICES: &str = "endpointslices";
pub const SERVICES: &str = "services";

/// One change, as a watch tells it.
struct Change {
    version: u64,
    kind: &'static str,
    event: Value,
}

/// An open watch stream: of which kind, asked with which selectors.
struct Watcher {
    kind: &'static str,
    query: HashMap<String, String>,
    tx: mpsc::UnboundedSender<Result<String, std::io::Error>>,
}

#[derive(Default)]
struct Inner {
    version: u64,
    objects: HashMap<&'static str, BTreeMap<String, Value>>,
    history: Vec<Change>,
    /// Watches from a version older than this are answered 410 Gone.
    oldest: u64,
    /// A watch too old is refused with an HTTP 410 rather than with an ERROR event.
    gone_as_status: bool,
    watchers: Vec<Watcher>,
    lists: HashMap<&'static str, usize>,
    /// The query of every request, in order.
    queries: Vec<(&'static str, HashMap<String, String>)>,
}

#[derive(Clone)]
pub struct ApiServer {
    pub url: String,
    inner: Arc<Mutex<Inner>>,
    task: Arc<tokio::task::JoinHandle<()>>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if Arc::strong_count(&self.task) == 1 {
            self.task.abort();
        }
    }
}

/// What a namespace's objects are requested with.
const TOKEN: &str = "test-token";

impl ApiServer {
    pub async fn start() -> Self {
        let inner = Arc::new(Mutex::new(Inner::default()));
        let app = axum::Router::new()
            .route(
                "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
                axum::routing::get(|s, p, q, h| serve(SLICES, s, p, q, h)),
            )
            .route(
                "/api/v1/namespaces/{ns}/services",
                axum::routing::get(|s, p, q, h| serve(SERVICES, s, p, q, h)),
            )
            .with_state(Arc::clone(&inner));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            url,
            inner,
            task: Arc::new(task),
        }
    }

    /// The bearer token it takes, to be written in a token file.
    pub fn token(&self) -> &'static str {
        TOKEN
    }

    /// Creates or replaces `object` of `kind`, telling the watches.
    pub fn apply(&self, kind: &'static str, object: Value) {
        let mut inner = self.inner.lock().unwrap();
        let exists = inner
            .objects
            .entry(kind)
            .or_default()
            .contains_key(&name(&object));
        let kind_of = if exists { "MODIFIED" } else { "ADDED" };
        inner.change(kind, kind_of, object);
    }

    pub fn delete(&self, kind: &'static str, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        let object = inner.objects.entry(kind).or_default().get(name).cloned();
        inner.change(
            kind,
            "DELETED",
            object.expect("deleting an object that is not there"),
        );
    }

    /// Ends every watch stream, as a restarting API server or a load balancer in between does.
    pub fn cut_watches(&self) {
        self.inner.lock().unwrap().watchers.clear();
    }

    /// Ends every watch, applies `objects` while none watches, and forgets every version
    /// before: the watches' resumption is refused (with an HTTP 410 if `as_status`, else an
    /// ERROR event), and only a list sees the change.
    pub fn expire_with(&self, as_status: bool, objects: &[(&'static str, Value)]) {
        let mut inner = self.inner.lock().unwrap();
        inner.watchers.clear();
        for (kind, object) in objects {
            inner.change(kind, "MODIFIED", object.clone());
        }
        inner.oldest = inner.version;
        inner.gone_as_status = as_status;
    }

    /// How many lists of `kind` were asked for.
    pub fn lists(&self, kind: &str) -> usize {
        self.inner
            .lock()
            .unwrap()
            .lists
            .get(kind)
            .copied()
            .unwrap_or(0)
    }

    /// How many watches of `kind` are streaming now.
    pub fn watching(&self, kind: &str) -> usize {
        let mut inner = self.inner.lock().unwrap();
        inner.watchers.retain(|w| !w.tx.is_closed());
        inner.watchers.iter().filter(|w| w.kind == kind).count()
    }

    /// The queries `kind` was requested with.
    pub fn queries(&self, kind: &str) -> Vec<HashMap<String, String>> {
        let inner = self.inner.lock().unwrap();
        let asked = inner.queries.iter().filter(|(k, _)| *k == kind);
        asked.map(|(_, q)| q.clone()).collect()
    }
}

fn name(object: &Value) -> String {
    object["metadata"]["name"].as_str().unwrap().to_owned()
}

impl Inner {
    fn change(&mut self, kind: &'static str, type_: &str, mut object: Value) {
        self.version += 1;
        object["metadata"]["resourceVersion"] = json!(self.version.to_string());
        let objects = self.objects.entry(kind).or_default();
        match type_ {
            "DELETED" => objects.remove(&name(&object)),
            _ => objects.insert(name(&object), object.clone()),
        };
        let event = json!({"type": type_, "object": object});
        self.watchers.retain(|w| {
            let told = w.kind != kind || !matches(&object, &w.query);
            told || w.tx.send(Ok(format!("{event}\n"))).is_ok()
        });
        self.history.push(Change {
            version: self.version,
            kind,
            event,
        });
    }
}

/// Whether `object` is one the selectors of `query` name: `key=value` pairs only, as prefixlb
/// asks (a label selector of equalities, `metadata.name=` as the only field selector).
fn matches(object: &Value, query: &HashMap<String, String>) -> bool {
    let pairs = |key: &str| {
        let selector = query.get(key).map(String::as_str).unwrap_or_default();
        let pairs = selector.split(',').filter(|p| !p.is_empty());
        pairs
            .map(|p| p.split_once('=').expect("an equality"))
            .collect::<Vec<_>>()
    };
    let metadata = &object["metadata"];
    pairs("labelSelector")
        .iter()
        .all(|(k, v)| metadata["labels"][k] == *v)
        && pairs("fieldSelector")
            .iter()
            .all(|(k, v)| *k == "metadata.name" && metadata["name"] == *v)
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn reply(code: StatusCode, body: impl Into<Body>) -> Response {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(body.into())
        .unwrap()
}

async fn serve(
    kind: &'static str,
    State(inner): State<Arc<Mutex<Inner>>>,
    Path(namespace): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let bearer = headers.get("authorization").and_then(|v| v.to_str().ok());
    if bearer != Some(&format!("Bearer {TOKEN}")) {
        let body = status(401, "Unauthorized", "Unauthorized").to_string();
        return reply(StatusCode::UNAUTHORIZED, body);
    }
    let mut inner = inner.lock().unwrap();
    inner.queries.push((kind, query.clone()));
    let objects = inner.objects.get(kind).cloned().unwrap_or_default();
    if query.get("watch").map(String::as_str) != Some("true") {
        *inner.lists.entry(kind).or_default() += 1;
        let (api_version, list_kind) = match kind {
            SLICES => ("discovery.k8s.io/v1", "EndpointSliceList"),
            _ => ("v1", "ServiceList"),
        };
        let items: Vec<&Value> = objects
            .values()
            .filter(|o| o["metadata"]["namespace"] == namespace.as_str() && matches(o, &query))
            .collect();
        let list = json!({"apiVersion": api_version, "kind": list_kind,
            "metadata": {"resourceVersion": inner.version.to_string()}, "items": items});
        return reply(StatusCode::OK, list.to_string());
    }
    let from: u64 = query["resourceVersion"].parse().unwrap();
    if from < inner.oldest {
        let gone = status(410, "Expired", "too old resource version");
        if inner.gone_as_status {
            return reply(StatusCode::GONE, gone.to_string());
        }
        let event = json!({"type": "ERROR", "object": gone});
        return reply(StatusCode::OK, format!("{event}\n"));
    }
    // What happened since `from`, then whatever happens while the stream stays open.
    let (tx, rx) = mpsc::unbounded_channel();
    let missed = inner
        .history
        .iter()
        .filter(|c| c.kind == kind && c.version > from);
    for change in missed.filter(|c| matches(&c.event["object"], &query)) {
        tx.send(Ok(format!("{}\n", change.event))).unwrap();
    }
    inner.watchers.push(Watcher { kind, query, tx });
    let stream = futures_util::stream::unfold(rx, |mut rx| async {
        rx.recv().await.map(|line| (line, rx))
    });
    reply(StatusCode::OK, Body::from_stream(stream))
}
