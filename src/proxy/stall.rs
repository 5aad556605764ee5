//! The idle limit of a streamed answer once it has begun. Pingora's read timeout is one
//! figure for every read of the response, the wait for the first token included, so it must
//! allow the longest prefill; a stream that stalls half-way would hold its slot and its client
//! for as long. So each stream gets a watchdog from its first body byte on: when the engine
//! sends nothing for the limit, the watchdog shuts the upstream socket down, Pingora's read
//! ends, and the client is told why (`fail_to_proxy` sends the error event).
//!
//! The watchdog holds a duplicate of the connection's descriptor: `shutdown` acts on the
//! socket, not the descriptor, and a descriptor of its own cannot be closed and handed to
//! another connection under it.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::task::AbortHandle;

use crate::routing::clock::now_ms;

/// One stream's watchdog; dropping it (the request ended) stops it. One pointer: every
/// request's context keeps room for it.
#[derive(Debug)]
pub struct StallGuard(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    /// When the engine last sent a byte of this answer.
    last_ms: AtomicU64,
    /// The watchdog cut the stream.
    fired: AtomicBool,
    task: OnceLock<AbortHandle>,
}

impl StallGuard {
    /// Watches the answer read from `fd` (a connection of this request's, open while its body
    /// is read), from now on. `None` when the descriptor cannot be duplicated: the stream then
    /// has only the read timeout.
    pub fn arm(fd: RawFd, limit: Duration) -> Option<Self> {
        // SAFETY: the caller's connection owns `fd` and is open for the duration of this call
        // (its body is being read); the duplicate is ours alone.
        let owned: OwnedFd = unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .ok()?;
        let shared = Arc::new(Shared::default());
        shared.last_ms.store(now_ms(), Ordering::Relaxed);
        let watched = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            loop {
                let quiet = now_ms().saturating_sub(watched.last_ms.load(Ordering::Relaxed));
                let quiet = Duration::from_millis(quiet);
                if quiet >= limit {
                    break;
                }
                tokio::time::sleep(limit - quiet).await;
            }
            watched.fired.store(true, Ordering::Relaxed);
            // SAFETY: a plain system call on a descriptor this task owns.
            unsafe { libc::shutdown(owned.as_raw_fd(), libc::SHUT_RDWR) };
        })
        .abort_handle();
        let _ = shared.task.set(task);
        Some(Self(shared))
    }

    /// A byte of the answer came.
    pub fn advanced(&self) {
        self.0.last_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Whether the watchdog cut the stream.
    pub fn fired(&self) -> bool {
        self.0.fired.load(Ordering::Relaxed)
    }
}

impl Drop for StallGuard {
    fn drop(&mut self) {
        if let Some(task) = self.0.task.get() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap());
        let (client, accepted) = tokio::join!(client, listener.accept());
        (client.unwrap(), accepted.unwrap().0)
    }

    #[tokio::test]
    async fn a_silent_stream_is_cut_and_a_moving_one_is_not() {
        let limit = Duration::from_millis(150);
        let (mut reader, mut engine) = pair().await;
        let guard = StallGuard::arm(reader.as_raw_fd(), limit).unwrap();
        // Bytes every 50 ms for 400 ms: more than the limit in all, never that long apart.
        let mut buf = [0u8; 16];
        for _ in 0..8 {
            engine.write_all(b"x").await.unwrap();
            assert_eq!(reader.read(&mut buf).await.unwrap(), 1);
            guard.advanced();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(!guard.fired());
        let started = Instant::now();
        let got = tokio::time::timeout(Duration::from_secs(5), reader.read(&mut buf)).await;
        assert!(
            matches!(got, Ok(Ok(0)) | Ok(Err(_))),
            "the read ended: {got:?}"
        );
        assert!(guard.fired());
        assert!(started.elapsed() >= limit - Duration::from_millis(60));
    }

    #[tokio::test]
    async fn a_dropped_guard_cuts_nothing() {
        let limit = Duration::from_millis(50);
        let (mut reader, mut engine) = pair().await;
        drop(StallGuard::arm(reader.as_raw_fd(), limit).unwrap());
        tokio::time::sleep(limit * 3).await;
        engine.write_all(b"late").await.unwrap();
        let mut buf = [0u8; 4];
        reader.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"late");
    }
}
