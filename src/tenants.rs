//! API keys and what each may spend: who a request is from, and whether its tenant has room.
//!
//! Keys are kept as SHA-256 digests, so the file is not a list of secrets. A key is looked up by
//! the digest of what the client presented: finding a digest in a map tells an attacker nothing
//! about the key behind another digest. Limits are per key: requests in flight at once, and
//! optionally a rate of requests and of prompt bytes, as token buckets that may go into debt by
//! one request (a prompt larger than a second's allowance is still served, and the wait it
//! costs falls on the tenant's next request).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::config::ConfigError;

/// The keys file as users write it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    keys: Vec<KeyEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    name: String,
    /// Hex SHA-256 of the key: `printf %s "$KEY" | sha256sum`.
    sha256: String,
    #[serde(default)]
    max_concurrent: Option<u32>,
    #[serde(default)]
    requests_per_second: Option<f64>,
    #[serde(default)]
    prompt_bytes_per_second: Option<f64>,
}

/// What one key may spend; `None` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    pub max_concurrent: Option<u32>,
    pub requests_per_second: Option<f64>,
    pub prompt_bytes_per_second: Option<f64>,
}

/// Why a tenant's request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverLimit {
    Concurrency,
    /// The request rate; retry after the duration.
    Requests(Duration),
    /// The prompt-byte rate; retry after the duration.
    PromptBytes(Duration),
}

impl OverLimit {
    pub fn as_str(self) -> &'static str {
        match self {
            OverLimit::Concurrency => "concurrency",
            OverLimit::Requests(_) => "request_rate",
            OverLimit::PromptBytes(_) => "prompt_byte_rate",
        }
    }

    /// When trying again may succeed, in whole seconds (at least 1, as `Retry-After` counts).
    pub fn retry_after_secs(self) -> u32 {
        let wait = match self {
            OverLimit::Concurrency => Duration::from_secs(1),
            OverLimit::Requests(d) | OverLimit::PromptBytes(d) => d,
        };
        (wait.as_secs_f64().ceil() as u32).max(1)
    }
}

/// The longest wait a refusal names: beyond it, a client is better told to come back later
/// than given a date.
const LONGEST_WAIT: Duration = Duration::from_secs(3600);

/// A token bucket that holds a second's allowance and may be overdrawn by one take.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(rate: f64, now: Instant) -> Self {
        Self {
            tokens: rate.max(1.0),
            at: now,
        }
    }

    /// Takes `cost` once the bucket holds it, or a full bucket for a cost larger than that
    /// (which overdraws it); otherwise says how long until it does.
    fn take(&mut self, rate: f64, cost: f64, now: Instant) -> Result<(), Duration> {
        let capacity = rate.max(1.0);
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate).min(capacity);
        self.at = now;
        let needed = cost.min(capacity);
        if self.tokens < needed {
            let wait = Duration::try_from_secs_f64((needed - self.tokens) / rate);
            return Err(wait.unwrap_or(Duration::MAX).min(LONGEST_WAIT));
        }
        self.tokens -= cost;
        Ok(())
    }
}

/// One API key's tenant: its limits and what it spends now. Kept across reloads of the file
/// while the key's name stays, so a reload does not hand a tenant fresh allowances.
#[derive(Debug)]
pub struct Tenant {
    name: String,
    limits: Mutex<Limits>,
    in_flight: AtomicU32,
    requests: Mutex<Option<Bucket>>,
    bytes: Mutex<Option<Bucket>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update is one assignment: the value is whole after any panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Tenant {
    fn new(name: String, limits: Limits) -> Self {
        Self {
            name,
            limits: Mutex::new(limits),
            in_flight: AtomicU32::new(0),
            requests: Mutex::new(None),
            bytes: Mutex::new(None),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn limits(&self) -> Limits {
        *lock(&self.limits)
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// A place for one request, if the tenant has room: held until the request ends.
    pub fn admit(self: &Arc<Self>) -> Result<TenantSlot, OverLimit> {
        self.admit_at(Instant::now())
    }

    fn admit_at(self: &Arc<Self>, now: Instant) -> Result<TenantSlot, OverLimit> {
        let limits = self.limits();
        let cap = limits.max_concurrent.unwrap_or(u32::MAX);
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .map_err(|_| OverLimit::Concurrency)?;
        let slot = TenantSlot(Arc::clone(self));
        if let Some(rate) = limits.requests_per_second {
            take(&self.requests, rate, 1.0, now).map_err(OverLimit::Requests)?;
        }
        Ok(slot)
    }

    /// Charges a request's prompt bytes to the tenant's byte rate.
    pub fn charge_prompt(&self, bytes: usize) -> Result<(), OverLimit> {
        self.charge_prompt_at(bytes, Instant::now())
    }

    fn charge_prompt_at(&self, bytes: usize, now: Instant) -> Result<(), OverLimit> {
        match self.limits().prompt_bytes_per_second {
            Some(rate) => {
                take(&self.bytes, rate, bytes as f64, now).map_err(OverLimit::PromptBytes)
            }
            None => Ok(()),
        }
    }
}

fn take(
    bucket: &Mutex<Option<Bucket>>,
    rate: f64,
    cost: f64,
    now: Instant,
) -> Result<(), Duration> {
    lock(bucket)
        .get_or_insert_with(|| Bucket::full(rate, now))
        .take(rate, cost, now)
}

/// A tenant's hold on one of its concurrent requests; released when dropped.
#[derive(Debug)]
pub struct TenantSlot(Arc<Tenant>);

impl Drop for TenantSlot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a request has no tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    Missing,
    Invalid,
}

impl AuthFailure {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing",
            AuthFailure::Invalid => "invalid",
        }
    }
}

type Digest32 = [u8; 32];

/// What the proxy does with API keys.
#[derive(Debug, Clone)]
pub struct ClientAuth {
    pub tenants: Arc<Tenants>,
    /// Whether the client's `Authorization` header goes on to the engine.
    pub forward_key: bool,
}

/// The keys in force, swapped whole when the file changes.
#[derive(Debug, Default)]
pub struct Tenants {
    by_digest: ArcSwap<HashMap<Digest32, Arc<Tenant>>>,
}

impl Tenants {
    /// The tenants a keys file lists; an invalid file is an error naming the entry.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let tenants = Self::default();
        tenants.replace(text)?;
        Ok(tenants)
    }

    /// Takes the keys `text` lists in place of the current ones. A tenant whose name stays
    /// keeps what it spends now.
    pub fn replace(&self, text: &str) -> Result<usize, ConfigError> {
        let file: KeysFile =
            serde_yaml::from_str(text).map_err(|e| ConfigError::new("keys", e.to_string()))?;
        let current: HashMap<String, Arc<Tenant>> = self
            .by_digest
            .load()
            .values()
            .map(|t| (t.name.clone(), Arc::clone(t)))
            .collect();
        let mut entries = Vec::with_capacity(file.keys.len());
        let (mut names, mut digests) = (
            std::collections::HashSet::new(),
            std::collections::HashSet::new(),
        );
        for (i, entry) in file.keys.into_iter().enumerate() {
            let field = format!("keys[{i}]");
            let digest = parse_digest(&entry.sha256)
                .ok_or_else(|| ConfigError::new(&field, "sha256 must be 64 hex digits"))?;
            if entry.name.is_empty() || !names.insert(entry.name.clone()) {
                return Err(ConfigError::new(&field, "each key needs a name of its own"));
            }
            if !digests.insert(digest) {
                return Err(ConfigError::new(&field, "the same key is listed twice"));
            }
            if entry.max_concurrent == Some(0) {
                return Err(ConfigError::new(
                    &field,
                    "max_concurrent must be at least 1",
                ));
            }
            let limits = Limits {
                max_concurrent: entry.max_concurrent,
                requests_per_second: positive(&field, entry.requests_per_second)?,
                prompt_bytes_per_second: positive(&field, entry.prompt_bytes_per_second)?,
            };
            entries.push((digest, entry.name, limits));
        }
        // Only a file valid throughout changes anything.
        let by_digest: HashMap<_, _> = entries
            .into_iter()
            .map(|(digest, name, limits)| {
                let tenant = match current.get(&name) {
                    Some(t) => {
                        *lock(&t.limits) = limits;
                        Arc::clone(t)
                    }
                    None => Arc::new(Tenant::new(name, limits)),
                };
                (digest, tenant)
            })
            .collect();
        let n = by_digest.len();
        self.by_digest.store(Arc::new(by_digest));
        Ok(n)
    }

    /// The tenant of a request's `Authorization` header value.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Arc<Tenant>, AuthFailure> {
        let value = authorization.ok_or(AuthFailure::Missing)?;
        let key = bearer(value).ok_or(AuthFailure::Invalid)?;
        let digest: Digest32 = Sha256::digest(key).into();
        self.by_digest
            .load()
            .get(&digest)
            .cloned()
            .ok_or(AuthFailure::Invalid)
    }

    /// Every tenant, for the metrics.
    pub fn all(&self) -> Vec<Arc<Tenant>> {
        self.by_digest.load().values().cloned().collect()
    }
}

fn positive(field: &str, rate: Option<f64>) -> Result<Option<f64>, ConfigError> {
    match rate {
        Some(r) if !(r.is_finite() && r > 0.0) => {
            Err(ConfigError::new(field, "a rate must be a positive number"))
        }
        r => Ok(r),
    }
}

/// The key of `Bearer <key>` (the scheme in any case, as RFC 9110 has it).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let key = rest.trim_ascii();
    (!key.is_empty()).then_some(key)
}

fn parse_digest(hex: &str) -> Option<Digest32> {
    let hex = hex.trim().as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(hex.chunks_exact(2)) {
        let text = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(text, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest_hex(key: &str) -> String {
        Sha256::digest(key.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn file(entries: &[(&str, &str, &str)]) -> String {
        let mut text = String::from("keys:\n");
        for (name, key, extra) in entries {
            text.push_str(&format!(
                "  - {{name: {name}, sha256: {}{extra}}}\n",
                digest_hex(key)
            ));
        }
        text
    }

    #[test]
    fn a_listed_key_finds_its_tenant_and_others_do_not() {
        let t = Tenants::parse(&file(&[("a", "sk-a", ""), ("b", "sk-b", "")])).unwrap();
        assert_eq!(t.authenticate(Some(b"Bearer sk-a")).unwrap().name(), "a");
        assert_eq!(t.authenticate(Some(b"bearer  sk-b ")).unwrap().name(), "b");
        assert_eq!(
            t.authenticate(Some(b"Bearer sk-c")).unwrap_err(),
            AuthFailure::Invalid
        );
        assert_eq!(
            t.authenticate(Some(b"Basic sk-a")).unwrap_err(),
            AuthFailure::Invalid
        );
        assert_eq!(
            t.authenticate(Some(b"Bearer ")).unwrap_err(),
            AuthFailure::Invalid
        );
        assert_eq!(t.authenticate(None).unwrap_err(), AuthFailure::Missing);
    }

    #[test]
    fn bad_files_are_refused_with_the_entry_named() {
        for (text, field) in [
            ("keys:\n  - {name: a, sha256: abc}\n", "keys[0]"),
            (
                file(&[("a", "k1", ""), ("a", "k2", "")]).as_str(),
                "keys[1]",
            ),
            (
                file(&[("a", "k1", ""), ("b", "k1", "")]).as_str(),
                "keys[1]",
            ),
            (
                file(&[("a", "k", ", max_concurrent: 0")]).as_str(),
                "keys[0]",
            ),
            (
                file(&[("a", "k", ", requests_per_second: -1")]).as_str(),
                "keys[0]",
            ),
        ] {
            let e = Tenants::parse(text).unwrap_err().to_string();
            assert!(e.contains(field), "{text}: {e}");
        }
        assert!(Tenants::parse("keys: [{name: a}]").is_err());
    }

    #[test]
    fn concurrency_cap_holds_and_a_released_slot_is_given_again() {
        let t = Tenants::parse(&file(&[("a", "k", ", max_concurrent: 2")])).unwrap();
        let a = t.authenticate(Some(b"Bearer k")).unwrap();
        let first = a.admit().unwrap();
        let _second = a.admit().unwrap();
        assert_eq!(a.admit().unwrap_err(), OverLimit::Concurrency);
        drop(first);
        assert!(a.admit().is_ok());
        assert_eq!(a.in_flight(), 1);
    }

    #[test]
    fn a_refused_rate_does_not_hold_a_concurrent_slot() {
        let t = Tenants::parse(&file(&[("a", "k", ", requests_per_second: 2")])).unwrap();
        let a = t.authenticate(Some(b"Bearer k")).unwrap();
        let now = Instant::now();
        drop(a.admit_at(now).unwrap());
        drop(a.admit_at(now).unwrap());
        let refused = a.admit_at(now).unwrap_err();
        assert!(matches!(refused, OverLimit::Requests(d) if d > Duration::ZERO));
        assert_eq!(refused.retry_after_secs(), 1);
        assert_eq!(a.in_flight(), 0);
        assert!(a.admit_at(now + Duration::from_millis(600)).is_ok());
    }

    #[test]
    fn a_prompt_over_a_seconds_allowance_passes_once_and_the_debt_delays_the_next() {
        let t = Tenants::parse(&file(&[("a", "k", ", prompt_bytes_per_second: 1000")])).unwrap();
        let a = t.authenticate(Some(b"Bearer k")).unwrap();
        let now = Instant::now();
        a.charge_prompt_at(5000, now).unwrap();
        let refused = a.charge_prompt_at(10, now).unwrap_err();
        // 4,000 bytes of debt and 10 more at 1,000 a second.
        assert_eq!(refused, OverLimit::PromptBytes(Duration::from_millis(4010)));
        assert_eq!(refused.retry_after_secs(), 5);
        a.charge_prompt_at(10, now + Duration::from_millis(4010))
            .unwrap();
    }

    #[test]
    fn a_tiny_rate_names_a_bounded_wait() {
        let t = Tenants::parse(&file(&[("a", "k", ", requests_per_second: 1e-300")])).unwrap();
        let a = t.authenticate(Some(b"Bearer k")).unwrap();
        let now = Instant::now();
        drop(a.admit_at(now).unwrap());
        assert_eq!(
            a.admit_at(now).unwrap_err(),
            OverLimit::Requests(LONGEST_WAIT)
        );
    }

    #[test]
    fn a_reload_keeps_a_named_tenants_spending_and_drops_removed_keys() {
        let t =
            Tenants::parse(&file(&[("a", "k", ", max_concurrent: 1"), ("b", "kb", "")])).unwrap();
        let held = t.authenticate(Some(b"Bearer k")).unwrap().admit().unwrap();
        t.replace(&file(&[("a", "k", ", max_concurrent: 1")]))
            .unwrap();
        let a = t.authenticate(Some(b"Bearer k")).unwrap();
        assert_eq!(a.in_flight(), 1);
        assert_eq!(a.admit().unwrap_err(), OverLimit::Concurrency);
        drop(held);
        assert_eq!(a.in_flight(), 0);
        assert_eq!(
            t.authenticate(Some(b"Bearer kb")).unwrap_err(),
            AuthFailure::Invalid
        );
        // A bad file leaves the keys as they were.
        assert!(t.replace("keys: 3").is_err());
        assert!(t.authenticate(Some(b"Bearer k")).is_ok());
    }
}
