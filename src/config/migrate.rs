//! Old configuration files keep loading: each key that moved is taken from its old place and
//! put at its new one on the parsed YAML, before it is read into the schema, and the move is
//! reported so that the operator can rename it. An old key beside its new one is refused.

use std::fmt;

use serde_yaml::{Mapping, Value};

use super::error::ConfigError;

/// A key that moved: its old path, its new one, and the factor a number is scaled by on the
/// way (a unit change; 1 for none).
pub struct Move {
    pub old: &'static str,
    pub new: &'static str,
    pub scale: u64,
}

const fn moved(old: &'static str, new: &'static str) -> Move {
    Move { old, new, scale: 1 }
}

/// Every key that moved, in the order they are applied: `access_log` (the format) becomes a
/// section before `access_log_key` moves into it.
pub const MOVES: &[Move] = &[
    moved(
        "routing.prefill_tokens_per_second",
        "routing.least_cost.prefill_tokens_per_second",
    ),
    moved("routing.candidates", "routing.least_cost.candidates"),
    moved(
        "routing.shared_prefix_placement",
        "routing.least_cost.shared_prefix_placement",
    ),
    moved("routing.vnodes_per_weight", "advanced.vnodes_per_weight"),
    Move {
        old: "routing.prefix_record_mib",
        new: "advanced.prefix_record_bytes",
        scale: 1 << 20,
    },
    moved("routing.peek_limit_bytes", "proxy.peek.limit_bytes"),
    moved("routing.peek_timeout_ms", "proxy.peek.timeout_ms"),
    moved("limits.peek_memory_bytes", "proxy.peek.memory_bytes"),
    moved("limits.max_body_bytes", "proxy.max_body_bytes"),
    moved(
        "limits.client_write_timeout_ms",
        "proxy.client_write_timeout_ms",
    ),
    moved("models.default", "proxy.default_model"),
    moved("routing.key.chat_path", "endpoints.chat_path"),
    moved("routing.key.completions_path", "endpoints.completions_path"),
    moved("routing.key.generate_path", "endpoints.generate_path"),
    moved("access_log", "access_log.format"),
    moved("access_log_key", "access_log.hash_secret"),
];

impl fmt::Display for Move {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is now {}", self.old, self.new)?;
        if self.scale != 1 {
            write!(f, " (its value times {})", self.scale)?;
        }
        Ok(())
    }
}

/// Moves every old key of `doc` to its new place; returns the moves made.
pub fn migrate(doc: &mut Value) -> Result<Vec<&'static Move>, ConfigError> {
    let mut renamed = Vec::new();
    for m in MOVES {
        let Some(mut value) = take(doc, m.old) else {
            continue;
        };
        if get(doc, m.new).is_some() {
            return Err(ConfigError::new(
                m.old,
                format!(
                    "is the old name of {}, which is set too: keep only {}",
                    m.new, m.new
                ),
            ));
        }
        if m.scale != 1 {
            if let Some(n) = value.as_u64() {
                let scaled = n
                    .checked_mul(m.scale)
                    .ok_or_else(|| ConfigError::new(m.old, format!("{n} is too large")))?;
                value = Value::from(scaled);
            }
        }
        put(doc, m.new, value)?;
        renamed.push(m);
    }
    Ok(renamed)
}

/// An error about a key the file wrote under its old name says that name too.
pub fn name_old(mut e: ConfigError, renamed: &[&Move]) -> ConfigError {
    let under = |field: &str, path: &str| {
        field
            .strip_prefix(path)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
    };
    if let Some(r) = renamed.iter().find(|r| under(&e.field, r.new)) {
        e.reason = format!("{} (written as {}, its old name)", e.reason, r.old);
    }
    e
}

fn get<'a>(doc: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .try_fold(doc, |v, key| v.as_mapping()?.get(key))
}

/// Removes the value at `path`, and the sections that held only it. A section is never an
/// old key's value: a mapping there is the new form of a key that became a section.
fn take(doc: &mut Value, path: &str) -> Option<Value> {
    let (key, rest) = path
        .split_once('.')
        .map_or((path, None), |(k, r)| (k, Some(r)));
    let map = doc.as_mapping_mut()?;
    let taken = match rest {
        None if map.get(key)?.is_mapping() => return None,
        None => map.remove(key)?,
        Some(rest) => {
            let inner = map.get_mut(key)?;
            let taken = take(inner, rest)?;
            if inner.as_mapping().is_some_and(Mapping::is_empty) {
                map.remove(key);
            }
            taken
        }
    };
    Some(taken)
}

fn put(doc: &mut Value, path: &str, value: Value) -> Result<(), ConfigError> {
    let names: Vec<&str> = path.split('.').collect();
    let (key, sections) = names.split_last().expect("a path names a key");
    let mut at = doc;
    for (i, name) in sections.iter().enumerate() {
        at = section(at, &sections[..i])?
            .entry((*name).into())
            .or_insert(Value::Null);
    }
    section(at, sections)?.insert((*key).into(), value);
    Ok(())
}

/// The mapping at `path`, made one if the file left it empty.
fn section<'a>(v: &'a mut Value, path: &[&str]) -> Result<&'a mut Mapping, ConfigError> {
    if v.is_null() {
        *v = Value::Mapping(Mapping::new());
    }
    v.as_mapping_mut()
        .ok_or_else(|| ConfigError::new(path.join("."), "must be a section"))
}
