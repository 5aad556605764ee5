//! In-flight counts shared between the processes of an upgrade, so that no GPU carries more
//! than its `max_in_flight` while an old process still streams and a new one routes.
//!
//! A process alone routes from its own atomics. Once two overlap (the old one is told to hand
//! its sockets over; the new one starts with `-u`), both go through one file in the runtime
//! directory, under `flock`: each choice reads what the others carry, chooses, and writes back
//! its own counts before the lock is released, so two processes can never both take a GPU's
//! last slot. Entries of processes that died are dropped; a process leaves the file when it
//! exits, and goes back to its atomics alone once nobody else is in it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::router::Router;
use crate::routing::clock::unix_ms;
use crate::routing::Decision;

/// How often a sharing process publishes what it released, and looks whether it is alone.
pub const TICK: Duration = Duration::from_millis(50);

/// How long a sharing process must find nobody else in the file before it routes alone again:
/// longer than a new process takes to write its first entry.
const LONELY: Duration = Duration::from_secs(1);

/// What one process carries, and how long its waiting line is.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct Entry {
    /// Per peer: the requests it has in flight.
    counts: HashMap<String, u32>,
    /// When the waiter at the front of its line joined it (ms since the Unix epoch).
    waiting_since_ms: Option<u64>,
}

/// Per process id.
type Table = HashMap<u32, Entry>;

pub struct SharedLoad {
    router: Arc<Router>,
    path: PathBuf,
    sharing: AtomicBool,
    /// Since when the file has held nobody else, while sharing.
    alone_since: Mutex<Option<Instant>>,
    /// Serialises this process's own use of the file: `flock` excludes other processes only.
    file: Mutex<Option<File>>,
}

/// The file, locked for as long as this lives.
struct Locked<'a> {
    file: std::sync::MutexGuard<'a, Option<File>>,
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        if let Some(f) = self.file.as_ref() {
            // SAFETY: flock on a descriptor this process owns, open for the guard's lifetime.
            unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_UN) };
        }
    }
}

impl Locked<'_> {
    fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("a locked file is open")
    }

    fn read(&mut self) -> Table {
        let mut text = String::new();
        let f = self.file();
        if f.rewind().is_err() || f.read_to_string(&mut text).is_err() {
            return Table::new();
        }
        let mut table: Table = serde_json::from_str(&text).unwrap_or_default();
        table.retain(|&pid, _| alive(pid));
        table
    }

    fn write(&mut self, table: &Table) {
        let text = serde_json::to_string(table).unwrap_or_default();
        let f = self.file();
        let written = f
            .set_len(0)
            .and_then(|()| f.rewind())
            .and_then(|()| f.write_all(text.as_bytes()));
        if let Err(e) = written {
            log::warn!("cannot write the shared in-flight counts: {e}");
        }
    }
}

/// Whether a process with this id exists (a signal-0 probe; EPERM means it does).
fn alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

impl SharedLoad {
    /// The shared file beside `upgrade_sock`. A process started to take over (`-u`) shares
    /// from the start: its predecessor is still streaming.
    pub fn new(router: Arc<Router>, upgrade_sock: &Path, successor: bool) -> Self {
        let dir = upgrade_sock.parent().unwrap_or(Path::new("."));
        Self {
            router,
            path: dir.join("prefixlb.inflight"),
            sharing: AtomicBool::new(successor),
            alone_since: Mutex::new(None),
            file: Mutex::new(None),
        }
    }

    pub fn sharing(&self) -> bool {
        self.sharing.load(Ordering::Acquire)
    }

    fn lock(&self) -> std::io::Result<Locked<'_>> {
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if file.is_none() {
            *file = Some(
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&self.path)?,
            );
        }
        let fd = file.as_ref().map(|f| f.as_raw_fd()).unwrap_or(-1);
        // SAFETY: flock on a descriptor this process owns; it blocks only while another
        // process holds the lock for one choice.
        if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Locked { file })
    }

    /// This process's entry, from the live cluster and its waiting line.
    fn own(&self) -> Entry {
        let cluster = self.router.cluster();
        let counts = cluster
            .peers()
            .iter()
            .filter(|p| p.in_flight() > 0)
            .map(|p| (p.id().to_owned(), p.in_flight()))
            .collect();
        let waited = self.router.load().waiters().front_waited();
        Entry {
            counts,
            waiting_since_ms: waited.map(|w| unix_ms(SystemTime::now() - w)),
        }
    }

    /// Sets each peer's external load from the others' entries, and returns those. The process
    /// id is asked each time: this is made before a daemon forks.
    fn exchange(&self, locked: &mut Locked<'_>) -> Table {
        let mut table = locked.read();
        table.remove(&std::process::id());
        let others = |id: &str| -> u32 { table.values().filter_map(|e| e.counts.get(id)).sum() };
        self.router.load().set_siblings(!table.is_empty());
        self.router.cluster().set_external(others);
        table
    }

    /// Runs one choice of peer for a request already admitted (a retry). While sharing, it
    /// runs under the lock with the others' load in place, and what it took is in the file
    /// before anyone else chooses.
    pub fn choose(&self, choose: impl FnOnce() -> Decision) -> Decision {
        self.locked_choice(false, choose)
    }

    /// Runs one choice of peer for a request that takes its turn in the waiting line: while
    /// sharing, it also gives way to another process whose line has waited longer than this
    /// one's. Without that, the process whose releases wake its own waiters at once (the one
    /// taking new connections) would take every freed slot, and the other's line would starve.
    pub fn choose_in_turn(&self, choose: impl FnOnce() -> Decision) -> Decision {
        self.locked_choice(true, choose)
    }

    fn locked_choice(&self, in_turn: bool, choose: impl FnOnce() -> Decision) -> Decision {
        if !self.sharing() {
            return choose();
        }
        let mut locked = match self.lock() {
            Ok(l) => l,
            Err(e) => {
                log::warn!("cannot lock {}: choosing alone: {e}", self.path.display());
                return choose();
            }
        };
        let mut table = self.exchange(&mut locked);
        let mine = self.own().waiting_since_ms;
        let oldest_elsewhere = table.values().filter_map(|e| e.waiting_since_ms).min();
        let give_way =
            in_turn && oldest_elsewhere.is_some_and(|theirs| mine.is_none_or(|mine| theirs < mine));
        let chosen = if give_way {
            Decision::Saturated
        } else {
            choose()
        };
        table.insert(std::process::id(), self.own());
        locked.write(&table);
        chosen
    }

    /// Starts sharing: called by the process that is about to hand its sockets over, before it
    /// does, so that its counts are in the file before its successor routes anything.
    pub fn begin(&self) {
        self.sharing.store(true, Ordering::Release);
        self.publish();
    }

    /// Publishes this process's counts; drops out of sharing once nobody else has been in the
    /// file for [`LONELY`].
    fn publish(&self) {
        let Ok(mut locked) = self.lock() else {
            return;
        };
        let mut table = self.exchange(&mut locked);
        {
            let mut alone = self.alone_since.lock().unwrap_or_else(|p| p.into_inner());
            if !table.is_empty() {
                *alone = None;
            } else if alone.get_or_insert_with(Instant::now).elapsed() >= LONELY {
                *alone = None;
                self.sharing.store(false, Ordering::Release);
                locked.write(&table);
                return;
            }
        }
        table.insert(std::process::id(), self.own());
        locked.write(&table);
        // Another process's releases are capacity this one's waiters may take.
        self.router.load().waiters().wake_fronts();
    }

    /// Leaves the file: the process is about to exit.
    pub fn leave(&self) {
        if let Ok(mut locked) = self.lock() {
            let mut table = locked.read();
            table.remove(&std::process::id());
            locked.write(&table);
        }
    }
}

/// The background task that publishes a sharing process's counts.
pub struct Publisher(pub Arc<SharedLoad>);

#[async_trait]
impl BackgroundService for Publisher {
    /// Publishes while sharing, through the drain too: it stops only with the process.
    async fn start(&self, _shutdown: ShutdownWatch) {
        let mut tick = tokio::time::interval(TICK);
        loop {
            tick.tick().await;
            if self.0.sharing() {
                self.0.publish();
            }
        }
    }
}
