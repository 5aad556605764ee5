//! The wait for a slot when every eligible peer is at its bound: a bounded FIFO of waiters,
//! woken by slot releases, not by polling.
//!
//! Only the waiter at the front may take a freed slot, so a request that came later cannot pass
//! one that has waited longer. Every release wakes the front; a front that gets its slot leaves
//! and wakes the next one, so a burst of releases drains as many waiters as it can serve. A
//! newcomer goes straight to a peer only while nobody waits.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::select::{Decision, Routed};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimit {
    /// Waiters allowed at once; 0 rejects a saturated request at once.
    pub max_waiting: usize,
    pub timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// No peer is eligible at all: waiting would not help.
    NoPeer,
    QueueFull,
    Timeout,
    /// The chosen peer failed to connect and every other one is at its bound.
    RetrySaturated,
}

impl Rejection {
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::NoPeer => "no_peer",
            Rejection::QueueFull => "queue_full",
            Rejection::Timeout => "queue_timeout",
            Rejection::RetrySaturated => "retry_saturated",
        }
    }
}

#[derive(Debug, Default)]
pub struct WaitQueue {
    waiters: Mutex<VecDeque<Arc<Notify>>>,
    len: AtomicUsize,
}

impl WaitQueue {
    /// Requests waiting now.
    pub fn len(&self) -> usize {
        self.len.load(Ordering::SeqCst)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tells the front waiter that capacity may have appeared.
    pub fn wake_front(&self) {
        if self.is_empty() {
            return;
        }
        if let Some(front) = self.lock().front() {
            front.notify_one();
        }
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Arc<Notify>>> {
        // A waiter list is valid after any panic mid-update: every update is one push or remove.
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, me: &Arc<Notify>, max: usize) -> bool {
        let mut q = self.lock();
        if q.len() >= max {
            return false;
        }
        q.push_back(Arc::clone(me));
        self.len.store(q.len(), Ordering::SeqCst);
        true
    }

    fn is_front(&self, me: &Arc<Notify>) -> bool {
        self.lock().front().is_some_and(|f| Arc::ptr_eq(f, me))
    }

    fn remove(&self, me: &Arc<Notify>) {
        let mut q = self.lock();
        let was_front = q.front().is_some_and(|f| Arc::ptr_eq(f, me));
        q.retain(|w| !Arc::ptr_eq(w, me));
        self.len.store(q.len(), Ordering::SeqCst);
        if was_front {
            if let Some(next) = q.front() {
                next.notify_one();
            }
        }
    }

    /// Runs `select` until it routes the request, waiting in line while it reports the cluster
    /// saturated. `select` is called again after every wake-up, so it may look at a cluster
    /// rebuilt in the meantime. Returns the routed request and how long it waited.
    pub async fn admit(
        &self,
        limit: QueueLimit,
        mut select: impl FnMut() -> Decision,
    ) -> Result<(Routed, Duration), Rejection> {
        if self.is_empty() {
            match select() {
                Decision::Routed(r) => return Ok((r, Duration::ZERO)),
                Decision::NoPeer => return Err(Rejection::NoPeer),
                Decision::Saturated => {}
            }
        }
        let me = Arc::new(Notify::new());
        if !self.push(&me, limit.max_waiting) {
            return Err(Rejection::QueueFull);
        }
        // Leaves the line however this future ends: routed, rejected, timed out or dropped
        // because the client went away.
        let _place = Place {
            queue: self,
            me: &me,
        };
        let start = Instant::now();
        let deadline = start + limit.timeout;
        loop {
            if self.is_front(&me) {
                match select() {
                    Decision::Routed(r) => return Ok((r, start.elapsed())),
                    Decision::NoPeer => return Err(Rejection::NoPeer),
                    Decision::Saturated => {}
                }
            }
            // A wake that came between the check above and this wait is kept by `Notify` as a
            // permit, so it is not lost.
            if tokio::time::timeout_at(deadline, me.notified())
                .await
                .is_err()
            {
                return Err(Rejection::Timeout);
            }
        }
    }
}

struct Place<'a> {
    queue: &'a WaitQueue,
    me: &'a Arc<Notify>,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.queue.remove(self.me);
    }
}
