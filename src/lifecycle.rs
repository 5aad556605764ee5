//! How the process stops: signals, the drain, and the exit as soon as the work is done.
//!
//! Pingora drains for the whole `grace_period_seconds` however little is left, closes every idle
//! keep-alive connection at once when its listeners stop (a client whose next request is on its
//! way sees the connection close under it), and ignores a second signal. Here:
//! - the signals are caught from the first moment ([`EarlySignals`]);
//! - SIGQUIT hands the sockets over only when a new process waits for them on the upgrade
//!   socket; otherwise the process goes on serving;
//! - SIGQUIT (upgrade) and SIGTERM (stop) start Pingora's graceful path, and a watcher of our own
//!   ends the process once no request has run for [`QUIET`] after the listeners closed, with
//!   Pingora's grace period as the upper bound;
//! - connections are never dropped while idle: a request that arrives on one during the drain is
//!   answered with `Connection: close`, so a keep-alive client is told, not cut off;
//! - a SIGINT or SIGTERM during the drain ends the process at once.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};
use tokio::signal::unix::{signal, Signal, SignalKind};

/// How long the process stays after its last request ended (or its listeners closed): a
/// keep-alive client that got its last response just before has this long to send the next
/// request on the same connection, which is then answered, with `Connection: close`.
pub const QUIET: Duration = Duration::from_millis(500);

fn now_ms() -> u64 {
    static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
    EPOCH.elapsed().as_millis() as u64
}

/// The requests the process is serving, and whether it still accepts new connections.
#[derive(Debug, Default)]
pub struct Activity {
    requests: AtomicUsize,
    /// When the last request ended or the listeners closed, whichever came later.
    settled_ms: AtomicU64,
    closed: AtomicBool,
}

/// One request being served; dropping it ends it.
#[derive(Debug)]
pub struct Request(Arc<Activity>);

impl Drop for Request {
    fn drop(&mut self) {
        self.0.settled_ms.store(now_ms(), Ordering::Relaxed);
        self.0.requests.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Activity {
    pub fn request(self: &Arc<Self>) -> Request {
        self.requests.fetch_add(1, Ordering::AcqRel);
        Request(Arc::clone(self))
    }

    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::Acquire)
    }

    /// The proxy's listeners have stopped accepting: from now on, no new connection comes.
    pub fn close(&self) {
        self.settled_ms.store(now_ms(), Ordering::Relaxed);
        self.closed.store(true, Ordering::Release);
    }

    /// Closed, nothing running, and quiet for `quiet`: nothing is left that exiting would cut.
    pub fn done(&self, quiet: Duration) -> bool {
        self.closed.load(Ordering::Acquire)
            && self.requests() == 0
            && now_ms().saturating_sub(self.settled_ms.load(Ordering::Relaxed))
                >= quiet.as_millis() as u64
    }
}

/// The shutdown signals, caught from the first moment of the process: their default actions end
/// it (SIGQUIT with a core dump), and a signal that comes while the process starts up is acted
/// on once it runs, not lost. SIGHUP, on which the control plane reloads, is held too: it is
/// harmless until then. A handler, once installed, stays for the life of the process.
pub struct EarlySignals {
    quit: Signal,
    term: Signal,
    int: Signal,
}

impl EarlySignals {
    pub fn install() -> std::io::Result<Self> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(async {
                drop(signal(SignalKind::hangup())?);
                Ok(Self {
                    quit: signal(SignalKind::quit())?,
                    term: signal(SignalKind::terminate())?,
                    int: signal(SignalKind::interrupt())?,
                })
            })
    }
}

/// Pingora's shutdown signals, with the drain watched to its end.
pub struct Signals {
    early: Mutex<Option<EarlySignals>>,
    activity: Arc<Activity>,
    upgrade_sock: PathBuf,
}

impl Signals {
    pub fn new(early: EarlySignals, activity: Arc<Activity>, upgrade_sock: PathBuf) -> Self {
        Self {
            early: Mutex::new(Some(early)),
            activity,
            upgrade_sock,
        }
    }
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        let taken = self.early.lock().unwrap_or_else(|p| p.into_inner()).take();
        let Some(mut signals) = taken else {
            // Pingora asks once; asked again, there is nothing left to wait with.
            return ShutdownSignal::FastShutdown;
        };
        let kind = loop {
            tokio::select! {
                _ = signals.quit.recv() => {
                    if successor_waits(&self.upgrade_sock).await {
                        break ShutdownSignal::GracefulUpgrade;
                    }
                    log::error!(
                        "SIGQUIT, but no new process waits on {}: not handing over, still serving",
                        self.upgrade_sock.display()
                    );
                }
                _ = signals.term.recv() => break ShutdownSignal::GracefulTerminate,
                _ = signals.int.recv() => return ShutdownSignal::FastShutdown,
            }
        };
        let activity = Arc::clone(&self.activity);
        // Pingora blocks the thread it runs this on while it hands the sockets over, and its
        // runtimes wind down before the grace period ends: the watch runs on a thread of its own.
        let spawned = std::thread::Builder::new()
            .name("prefixlb drain".into())
            .spawn(move || watch_drain(&activity, signals));
        if let Err(e) = spawned {
            log::warn!("cannot watch the drain, it lasts the whole grace period: {e}");
        }
        kind
    }
}

/// How long a SIGQUIT waits for a new process to listen on the upgrade socket, as long as
/// Pingora itself would try to hand the sockets over.
const SUCCESSOR_WAIT: Duration = Duration::from_secs(5);

/// Whether a new process listens on the upgrade socket, waiting for it a while. Pingora hands
/// the sockets over, then stops, whether or not anyone took them; a successor that died in
/// start-up must not take the running process down with it. A probe connect would be taken for
/// the hand-over itself, so the kernel's table of listening sockets is read instead.
async fn successor_waits(sock: &Path) -> bool {
    let deadline = tokio::time::Instant::now() + SUCCESSOR_WAIT;
    loop {
        match tokio::fs::read_to_string("/proc/net/unix").await {
            Ok(table) if listening(&table, sock) => return true,
            Ok(_) => {}
            // Without the table there is no telling: hand over, as Pingora would.
            Err(_) => return true,
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether `/proc/net/unix` lists a socket listening at `path`: its flags carry
/// `__SO_ACCEPTCON` (0x10000) and its state is unconnected.
fn listening(table: &str, path: &Path) -> bool {
    let Some(path) = path.to_str() else {
        return false;
    };
    table.lines().skip(1).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        f.len() >= 8
            && f[7] == path
            && u32::from_str_radix(f[3], 16).is_ok_and(|flags| flags & 0x10000 != 0)
    })
}

/// Ends the process when the drain is done, or at once on a second SIGINT or SIGTERM.
fn watch_drain(activity: &Activity, mut signals: EarlySignals) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            log::warn!("cannot watch the drain, it lasts the whole grace period: {e}");
            return;
        }
    };
    runtime.block_on(async {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tokio::select! {
                _ = signals.term.recv() => break log::warn!("SIGTERM during the drain: stopping now"),
                _ = signals.int.recv() => break log::warn!("SIGINT during the drain: stopping now"),
                _ = tick.tick() => if activity.done(QUIET) {
                    break log::info!("drained: no request left, exiting");
                },
            }
        }
    });
    std::process::exit(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_unix_socket_is_told_from_a_connected_one() {
        let table = "Num       RefCount Protocol Flags    Type St Inode Path
0000000000000000: 00000002 00000000 00010000 0001 01 1001 /run/prefixlb/upgrade.sock
0000000000000000: 00000003 00000000 00000000 0001 03 1002 /run/prefixlb/other.sock
";
        assert!(listening(table, Path::new("/run/prefixlb/upgrade.sock")));
        assert!(!listening(table, Path::new("/run/prefixlb/other.sock")));
        assert!(!listening(table, Path::new("/run/prefixlb/absent.sock")));
    }

    #[test]
    fn done_only_when_closed_idle_and_quiet() {
        let activity = Arc::new(Activity::default());
        let quiet = Duration::from_millis(30);
        let request = activity.request();
        activity.close();
        std::thread::sleep(quiet * 2);
        assert!(!activity.done(quiet), "a request is running");
        drop(request);
        assert!(!activity.done(quiet), "it just ended");
        std::thread::sleep(quiet * 2);
        assert!(activity.done(quiet));
        let open = Activity::default();
        std::thread::sleep(quiet * 2);
        assert!(!open.done(quiet), "still accepting");
    }
}
