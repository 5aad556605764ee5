//! One kind of object followed the way the API server means it to be: listed once, then
//! watched from the list's resourceVersion, the watch resumed from the last version seen when
//! it ends or breaks after running, and everything listed again when that version has expired
//! (410 Gone) or the watch fails outright. The current set is published on a
//! `tokio::sync::watch` channel, replaced whole when a new list answers, so that a reader never
//! sees it empty in between.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use kube::api::{ListParams, WatchEvent, WatchParams};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

/// What a reader sees of one kind: the objects by name once a list has succeeded, and the
/// latest failure while there is one.
#[derive(Debug, Clone)]
pub struct Listing<K> {
    pub objects: Option<BTreeMap<String, K>>,
    pub error: Option<String>,
}

impl<K> Default for Listing<K> {
    fn default() -> Self {
        Self {
            objects: None,
            error: None,
        }
    }
}

impl<K> Listing<K> {
    /// Whether the first list has answered, either way.
    pub fn answered(&self) -> bool {
        self.objects.is_some() || self.error.is_some()
    }
}

/// The objects of one kind to follow: those the selectors match.
#[derive(Debug, Clone, Default)]
pub struct Selectors {
    pub labels: Option<String>,
    pub fields: Option<String>,
}

/// How long one list may take: an API server that hangs is one that fails.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);
/// The server ends each watch after this; a shorter one than its default notices a
/// connection that died silently sooner.
const WATCH_SECONDS: u32 = 120;
/// Nothing at all (not even the end of the watch) for this long: the connection is dead.
const WATCH_IDLE: Duration = Duration::from_secs(WATCH_SECONDS as u64 + 10);
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// Slices of one Service are a handful; pages keep a huge selector's answers bounded.
const PAGE: u32 = 500;
/// A watch that lasted this long did run, even without events.
const RAN: Duration = Duration::from_secs(1);

/// Why a watch stopped.
enum Stop {
    /// Its version expired: list again after a pause.
    Gone,
    /// It ended or broke after it had run a while: watch again at once.
    Ended,
    /// It failed, or ended at once: list again after a pause.
    Failed(String),
}

/// Follows the objects `api` and `selectors` name into `tx`, until the task is aborted.
pub async fn follow<K>(api: Api<K>, selectors: Selectors, tx: watch::Sender<Listing<K>>)
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let what = K::plural(&()).into_owned();
    let mut backoff = Backoff::default();
    loop {
        let mut version = match list(&api, &selectors).await {
            Ok((objects, version)) => {
                tx.send_modify(|l| {
                    l.objects = Some(objects);
                    l.error = None;
                });
                version
            }
            Err(e) => {
                // The objects listed before stay: a failing API server is not an empty set.
                log::warn!("kubernetes: listing {what}: {e}");
                tx.send_modify(|l| l.error = Some(format!("listing {what}: {e}")));
                backoff.wait().await;
                continue;
            }
        };
        // A watch that ran resumes at once; one that expired or failed is followed by a
        // fresh list, after a pause that grows while they keep failing (only a watch that
        // ran resets it: a list that works is no sign the watch will).
        loop {
            match watch_from(&api, &selectors, &mut version, &tx).await {
                Stop::Ended => {
                    backoff.reset();
                    continue;
                }
                Stop::Gone => log::info!("kubernetes: the watch of {what} expired, listing again"),
                Stop::Failed(e) => log::warn!("kubernetes: watching {what}: {e}"),
            }
            backoff.wait().await;
            break;
        }
    }
}

/// Every object the selectors match, by name, and the version the list was read at.
async fn list<K>(
    api: &Api<K>,
    selectors: &Selectors,
) -> Result<(BTreeMap<String, K>, String), String>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let mut params = ListParams::default().limit(PAGE);
    params.label_selector.clone_from(&selectors.labels);
    params.field_selector.clone_from(&selectors.fields);
    let mut objects = BTreeMap::new();
    loop {
        let page = tokio::time::timeout(LIST_TIMEOUT, api.list(&params))
            .await
            .map_err(|_| format!("no answer within {LIST_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?;
        objects.extend(page.items.into_iter().map(|o| (o.name_any(), o)));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => return Ok((objects, page.metadata.resource_version.unwrap_or_default())),
        }
    }
}

/// Applies the events of one watch from `version` to `tx`, moving `version` along.
async fn watch_from<K>(
    api: &Api<K>,
    selectors: &Selectors,
    version: &mut String,
    tx: &watch::Sender<Listing<K>>,
) -> Stop
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut params = WatchParams::default().timeout(WATCH_SECONDS);
    params.label_selector.clone_from(&selectors.labels);
    params.field_selector.clone_from(&selectors.fields);
    let stream = match api.watch(&params, version).await {
        Ok(stream) => stream,
        Err(kube::Error::Api(status)) if status.code == 410 => return Stop::Gone,
        Err(e) => return Stop::Failed(e.to_string()),
    };
    let mut stream = stream.boxed();
    let started = tokio::time::Instant::now();
    let mut delivered = false;
    loop {
        let event = tokio::time::timeout(WATCH_IDLE, stream.try_next()).await;
        let ran = delivered || started.elapsed() >= RAN;
        let event = match event {
            Err(_) => return ended(ran, "silent for too long"),
            Ok(Ok(None)) => return ended(ran, "closed by the server at once"),
            Ok(Err(e)) => return ended(ran, &e.to_string()),
            Ok(Ok(Some(event))) => event,
        };
        // A bookmark alone is no sign of a working watch: a server may send one and close.
        delivered |= !matches!(event, WatchEvent::Bookmark(_));
        match event {
            WatchEvent::Added(o) | WatchEvent::Modified(o) => {
                moved_to(version, &o);
                tx.send_modify(|l| {
                    l.objects.get_or_insert_default().insert(o.name_any(), o);
                });
            }
            WatchEvent::Deleted(o) => {
                moved_to(version, &o);
                tx.send_modify(|l| {
                    l.objects.get_or_insert_default().remove(&o.name_any());
                });
            }
            WatchEvent::Bookmark(b) => *version = b.metadata.resource_version,
            WatchEvent::Error(status) if status.code == 410 => return Stop::Gone,
            // Anything else the server says ends the watch too: a version it complained of
            // is not worth resuming from.
            WatchEvent::Error(status) => return Stop::Failed(status.to_string()),
        }
    }
}

/// A watch that gave events or lasted ends as watches do; one that ended at once is failing.
fn ended(ran: bool, why: &str) -> Stop {
    match ran {
        true => Stop::Ended,
        false => Stop::Failed(why.to_owned()),
    }
}

fn moved_to<K: Resource>(version: &mut String, object: &K) {
    if let Some(v) = object.resource_version() {
        *version = v;
    }
}

/// Pauses that double from [`FIRST_BACKOFF`] to [`MAX_BACKOFF`] while failures go on.
struct Backoff(Duration);

impl Default for Backoff {
    fn default() -> Self {
        Self(FIRST_BACKOFF)
    }
}

impl Backoff {
    async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(MAX_BACKOFF);
    }

    fn reset(&mut self) {
        self.0 = FIRST_BACKOFF;
    }
}
