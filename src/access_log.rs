//! One line per request on standard output (the journal, under systemd), plain or JSON. The
//! routing key appears as its hash only: the prompt it comes from is private.
//!
//! Lines are written by a thread of their own, in batches: a worker thread only formats its
//! line and queues it, and never blocks on a slow stdout (a full pipe to the journal). A line
//! that finds the queue full is dropped and counted. Lines reach stdout within tens of
//! milliseconds.

use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::metrics::counters::ACCESS_LOG_DROPPED;
use crate::settings::AccessLogFormat;

/// Lines that may wait for the writer: a few seconds of a busy proxy.
const QUEUE: usize = 16 * 1024;

/// Lines queued and not yet written, across every log of this process.
static PENDING: AtomicUsize = AtomicUsize::new(0);

#[derive(Debug, Serialize)]
pub struct Entry<'a> {
    pub time: String,
    pub method: &'a str,
    pub path: &'a str,
    /// What the client got; 0 when it went away first.
    pub status: u16,
    pub peer: Option<&'a str>,
    pub route: Option<&'a str>,
    pub request_id: Option<&'a str>,
    /// The name of the client's API key (never the key).
    pub tenant: Option<&'a str>,
    pub key_source: Option<&'a str>,
    pub key_hash: Option<String>,
    pub ttft_ms: Option<u64>,
    pub duration_ms: u64,
    pub bytes_in: usize,
    pub bytes_out: usize,
    pub error: Option<String>,
}

pub struct AccessLog {
    format: AccessLogFormat,
    /// The secret the key hashes are keyed with.
    secret: Vec<u8>,
    /// The writer's queue, made with its writer at the first line; `None` when the writer
    /// could not start. Not at start-up: a daemon forks after the log is made, and a thread
    /// does not survive a fork, so the process that writes starts its writer.
    lines: OnceLock<Option<SyncSender<String>>>,
}

impl AccessLog {
    /// A log whose key hashes are keyed with `secret`, or with a random one of this process's
    /// when none is given (lines of one process then still group by key).
    pub fn new(format: AccessLogFormat, secret: Option<&str>) -> Self {
        let secret = match secret {
            Some(s) => s.as_bytes().to_vec(),
            None => {
                use std::hash::BuildHasher;
                let random = std::collections::hash_map::RandomState::new();
                [random.hash_one(1u8), random.hash_one(2u8)]
                    .iter()
                    .flat_map(|h| h.to_le_bytes())
                    .collect()
            }
        };
        Self {
            format,
            secret,
            lines: OnceLock::new(),
        }
    }

    /// How a routing key appears in the log: keyed, so that whoever reads the logs cannot
    /// confirm a guessed prompt by hashing it the way the router does.
    pub fn key_label(&self, hash: u64) -> String {
        let mut keyed = Vec::with_capacity(self.secret.len() + 8);
        keyed.extend_from_slice(&self.secret);
        keyed.extend_from_slice(&hash.to_le_bytes());
        format!("{:016x}", crate::routing::hash::murmur64(&keyed))
    }

    pub fn enabled(&self) -> bool {
        self.format != AccessLogFormat::Off
    }

    pub fn line(&self, e: &Entry<'_>) -> Option<String> {
        match self.format {
            AccessLogFormat::Off => None,
            AccessLogFormat::Json => serde_json::to_string(e).ok(),
            AccessLogFormat::Plain => {
                let dash = |v: Option<&str>| v.unwrap_or("-").to_owned();
                Some(format!(
                    "{} {} {} {} peer={} route={} request_id={} tenant={} key={}:{} ttft_ms={} duration_ms={} bytes_in={} bytes_out={} error={}",
                    e.time,
                    e.method,
                    e.path,
                    e.status,
                    dash(e.peer),
                    dash(e.route),
                    dash(e.request_id),
                    dash(e.tenant),
                    dash(e.key_source),
                    dash(e.key_hash.as_deref()),
                    e.ttft_ms.map_or("-".into(), |v| v.to_string()),
                    e.duration_ms,
                    e.bytes_in,
                    e.bytes_out,
                    e.error.as_deref().map_or("-".into(), |m| format!("{m:?}")),
                ))
            }
        }
    }

    /// Queues the line of `e` for the writer.
    pub fn write(&self, e: &Entry<'_>) {
        let Some(line) = self.line(e) else {
            return;
        };
        let Some(lines) = self.lines.get_or_init(start_writer) else {
            ACCESS_LOG_DROPPED.inc();
            return;
        };
        PENDING.fetch_add(1, Ordering::AcqRel);
        if lines.try_send(line).is_err() {
            PENDING.fetch_sub(1, Ordering::AcqRel);
            ACCESS_LOG_DROPPED.inc();
        }
    }
}

/// Starts the writer thread; its queue, or `None` (said once) when it cannot start.
fn start_writer() -> Option<SyncSender<String>> {
    let (tx, rx) = sync_channel(QUEUE);
    std::thread::Builder::new()
        .name("access log".into())
        .spawn(move || write_lines(rx))
        .map_err(|e| log::error!("no access log: cannot start its writer: {e}"))
        .ok()
        .map(|_| tx)
}

/// How long the writer lets lines gather after the first of a batch. It is not woken by each
/// line: on the one CPU a proxy may have, a wake-up per request cost more than the write it
/// saved.
const WRITE_EVERY: Duration = Duration::from_millis(20);

/// The writer: it sleeps until a line comes (a sender wakes only a receiver blocked on the
/// queue), lets more gather for `WRITE_EVERY`, then writes them all in a few large writes.
fn write_lines(lines: Receiver<String>) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, std::io::stdout());
    let mut open = true;
    while open {
        let Ok(first) = lines.recv() else {
            return;
        };
        std::thread::sleep(WRITE_EVERY);
        // A closed stdout must not take the process down with it.
        let _ = writeln!(out, "{first}");
        let mut batch = 1;
        loop {
            match lines.try_recv() {
                Ok(line) => {
                    let _ = writeln!(out, "{line}");
                    batch += 1;
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                // The log is gone (the proxy is shutting down): write what it left, and stop.
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let _ = out.flush();
        PENDING.fetch_sub(batch, Ordering::AcqRel);
    }
}

/// Waits, up to `limit`, until every queued line is written: called before the process exits.
pub fn drain(limit: Duration) {
    let start = Instant::now();
    while PENDING.load(Ordering::Acquire) > 0 && start.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_labels_are_keyed() {
        let (a, b) = (
            AccessLog::new(AccessLogFormat::Plain, Some("one secret")),
            AccessLog::new(AccessLogFormat::Plain, Some("another")),
        );
        let h = 0x1234_5678_9abc_def0;
        assert_eq!(a.key_label(h), a.key_label(h), "one key, one label");
        assert_ne!(a.key_label(h), b.key_label(h));
        assert_ne!(
            a.key_label(h),
            format!("{h:016x}"),
            "the routing hash itself"
        );
        let random = AccessLog::new(AccessLogFormat::Plain, None);
        assert_ne!(
            random.key_label(h),
            AccessLog::new(AccessLogFormat::Plain, None).key_label(h)
        );
    }

    fn entry() -> Entry<'static> {
        Entry {
            time: "2026-12-01T10:00:00Z".into(),
            method: "POST",
            path: "/v1/chat/completions",
            status: 200,
            peer: Some("10.0.0.1:8000"),
            route: Some("overflow"),
            request_id: Some("r-1"),
            tenant: Some("team-a"),
            key_source: Some("chat"),
            key_hash: Some("00ff00ff00ff00ff".into()),
            ttft_ms: Some(42),
            duration_ms: 1234,
            bytes_in: 900,
            bytes_out: 7000,
            error: None,
        }
    }

    #[test]
    fn plain_and_json_carry_the_same_fields() {
        let plain = AccessLog::new(AccessLogFormat::Plain, None)
            .line(&entry())
            .unwrap();
        assert_eq!(
            plain,
            "2026-12-01T10:00:00Z POST /v1/chat/completions 200 peer=10.0.0.1:8000 route=overflow request_id=r-1 tenant=team-a key=chat:00ff00ff00ff00ff ttft_ms=42 duration_ms=1234 bytes_in=900 bytes_out=7000 error=-"
        );
        let json: serde_json::Value = serde_json::from_str(
            &AccessLog::new(AccessLogFormat::Json, None)
                .line(&entry())
                .unwrap(),
        )
        .unwrap();
        assert_eq!(json["route"], "overflow");
        assert_eq!(json["tenant"], "team-a");
        assert_eq!(json["ttft_ms"], 42);
        assert_eq!(json["error"], serde_json::Value::Null);
        assert!(AccessLog::new(AccessLogFormat::Off, None)
            .line(&entry())
            .is_none());
    }
}
