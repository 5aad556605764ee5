//! The key store: the API keys in force, read from their file, and who a request is from.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::admission::Tenant;
use super::limits::Limits;
use crate::error::Error;

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
    pub fn parse(text: &str) -> Result<Self, Error> {
        let tenants = Self::default();
        tenants.replace(text)?;
        Ok(tenants)
    }

    /// Takes the keys `text` lists in place of the current ones. A tenant whose name stays
    /// keeps what it spends now.
    pub fn replace(&self, text: &str) -> Result<usize, Error> {
        let file: KeysFile =
            serde_yaml::from_str(text).map_err(|e| Error::new("keys", e.to_string()))?;
        let current: HashMap<String, Arc<Tenant>> = self
            .by_digest
            .load()
            .values()
            .map(|t| (t.name().to_owned(), Arc::clone(t)))
            .collect();
        let mut entries = Vec::with_capacity(file.keys.len());
        let (mut names, mut digests) = (HashSet::new(), HashSet::new());
        for (i, entry) in file.keys.into_iter().enumerate() {
            let field = format!("keys[{i}]");
            let digest = parse_digest(&entry.sha256)
                .ok_or_else(|| Error::new(&field, "sha256 must be 64 hex digits"))?;
            if entry.name.is_empty() || !names.insert(entry.name.clone()) {
                return Err(Error::new(&field, "each key needs a name of its own"));
            }
            if !digests.insert(digest) {
                return Err(Error::new(&field, "the same key is listed twice"));
            }
            if entry.max_concurrent == Some(0) {
                return Err(Error::new(&field, "max_concurrent must be at least 1"));
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
                        t.set_limits(limits);
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

fn positive(field: &str, rate: Option<f64>) -> Result<Option<f64>, Error> {
    match rate {
        Some(r) if !(r.is_finite() && r > 0.0) => {
            Err(Error::new(field, "a rate must be a positive number"))
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
    use crate::tenants::limits::OverLimit;

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
    fn a_key_carries_the_limits_its_entry_lists() {
        let extra = ", max_concurrent: 2, requests_per_second: 2, prompt_bytes_per_second: 1000";
        let t = Tenants::parse(&file(&[("a", "k", extra), ("b", "kb", "")])).unwrap();
        assert_eq!(
            t.authenticate(Some(b"Bearer k")).unwrap().limits(),
            Limits {
                max_concurrent: Some(2),
                requests_per_second: Some(2.0),
                prompt_bytes_per_second: Some(1000.0),
            }
        );
        let b = t.authenticate(Some(b"Bearer kb")).unwrap();
        assert_eq!(b.limits(), Limits::default());
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
