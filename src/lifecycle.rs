//! How the process stops: signals, the drain, and the exit as soon as the work is done.
//!
//! Pingora drains for the whole `grace_period_seconds` however little is left, closes every idle
//! keep-alive connection at once when its listeners stop (a client whose next request is on its
//! way sees the connection close under it), and ignores a second signal. Here:
//! - SIGHUP and SIGQUIT are harmless from the first moment ([`ignore_until_running`]);
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
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};
use tokio::signal::unix::{signal, Signal, SignalKind};

use crate::proxy::shared_load::SharedLoad;
use crate::routing::clock::now_ms;

/// How long the process stays after its last request ended (or its listeners closed): a
/// keep-alive client that got its last response just before has this long to send the next
/// request on the same connection, which is then answered, with `Connection: close`.
pub const QUIET: Duration = Duration::from_millis(500);

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

/// Makes SIGHUP and SIGQUIT harmless while the process starts: their default actions end it
/// (SIGQUIT with a core dump), and until the control plane and the shutdown watch run there is
/// nothing to reload and no sockets to hand over. Both are taken over by their handlers once
/// those run. A plain disposition, not a handler: it must survive daemonizing, which a signal
/// stream set up before the fork would not (the fork shares its wake-up pipe with the parent).
pub fn ignore_until_running() {
    // SAFETY: setting a signal's disposition to SIG_IGN installs no code and touches no memory;
    // it is sound at any point, in any thread.
    unsafe {
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
        libc::signal(libc::SIGQUIT, libc::SIG_IGN);
    }
}

struct Streams {
    quit: Signal,
    term: Signal,
    int: Signal,
}

/// Pingora's shutdown signals, with the drain watched to its end.
pub struct Signals {
    pub activity: Arc<Activity>,
    pub upgrade_sock: PathBuf,
    pub shared: Arc<SharedLoad>,
}

#[async_trait]
impl ShutdownSignalWatch for Signals {
    async fn recv(&self) -> ShutdownSignal {
        let (Ok(quit), Ok(term), Ok(int)) = (
            signal(SignalKind::quit()),
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            log::error!("cannot listen for shutdown signals: stopping");
            return ShutdownSignal::FastShutdown;
        };
        let mut signals = Streams { quit, term, int };
        let kind = loop {
            tokio::select! {
                _ = signals.quit.recv() => {
                    if successor_waits(&self.upgrade_sock).await {
                        // Counts in the shared file before the successor has a socket to
                        // route from.
                        self.shared.begin();
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
        let (activity, shared) = (Arc::clone(&self.activity), Arc::clone(&self.shared));
        // Pingora blocks the thread it runs this on while it hands the sockets over, and its
        // runtimes wind down before the grace period ends: the watch runs on a thread of its own.
        let spawned = std::thread::Builder::new()
            .name("prefixlb drain".into())
            .spawn(move || watch_drain(&activity, &shared, signals));
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
fn watch_drain(activity: &Activity, shared: &SharedLoad, mut signals: Streams) {
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
    shared.leave();
    crate::access_log::drain(Duration::from_secs(1));
    crate::traces::drain(Duration::from_secs(2));
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
