//! The wait for a slot when every eligible peer is at its bound: a bounded line of waiters,
//! woken by slot releases, not by polling.
//!
//! The line is fair between lanes (tenants): a waiter joins behind one waiter of every other
//! lane per waiter its own lane already has in line, so a burst of one lane does not queue
//! ahead of everyone, and a lane may fill three quarters of the line at most; within a lane,
//! and with a single lane, it is first come, first served.
//! Only the waiter at the front may take a freed slot, so a request cannot pass one placed
//! ahead of it. Every release wakes the front; a front that gets its slot leaves
//! and wakes the next one, so a burst of releases drains as many waiters as it can serve. A
//! newcomer goes straight to a peer only while nobody waits.
//!
//! Requests wait in one line per pool ([`WaitLines`]): a request waits only behind those that
//! want the same peers, so a model whose peers are all busy holds up no other model.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::sync::Notify;
use tokio::time::Instant;

/// What one try at taking capacity gave, as the line reads it.
#[derive(Debug)]
pub enum Outcome<T> {
    Taken(T),
    /// Every unit is busy; a release may free one.
    Busy,
    /// Nothing will come of waiting.
    Hopeless,
}

/// A try at taking capacity, whatever it takes: the line only needs its [`Outcome`].
pub trait Attempt {
    type Taken;
    fn outcome(self) -> Outcome<Self::Taken>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimit {
    /// Waiters allowed at once; 0 rejects a saturated request at once.
    pub max_waiting: usize,
    pub timeout: Duration,
}

impl Default for QueueLimit {
    fn default() -> Self {
        Self {
            max_waiting: 1024,
            timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// No peer is eligible at all: waiting would not help.
    NoPeer,
    QueueFull,
    Timeout,
}

impl Rejection {
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::NoPeer => "no_peer",
            Rejection::QueueFull => "queue_full",
            Rejection::Timeout => "queue_timeout",
        }
    }
}

#[derive(Debug)]
struct Waiter {
    wake: Arc<Notify>,
    since: Instant,
    lane: u64,
    /// The line is ordered by round: a lane's n-th waiter is served in the n-th round from
    /// the one being served when it joined.
    round: u64,
}

#[derive(Debug, Default)]
pub struct WaitQueue {
    waiters: Mutex<VecDeque<Waiter>>,
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
            front.wake.notify_one();
        }
    }

    /// How long the waiter at the front has waited, if anyone waits.
    pub fn front_waited(&self) -> Option<Duration> {
        if self.is_empty() {
            return None;
        }
        self.lock().front().map(|w| w.since.elapsed())
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Waiter>> {
        // A waiter list is valid after any panic mid-update: every update is one push or remove.
        self.waiters.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, me: &Arc<Notify>, lane: u64, max: usize) -> bool {
        let mut q = self.lock();
        if q.len() >= max {
            return false;
        }
        // A tenant's lane leaves a quarter of the line to the others, so that its burst does
        // not fill the line and turn everyone else away. Lane 0 (no tenants) is everyone's.
        if lane != 0 && q.iter().filter(|w| w.lane == lane).count() >= max - max / 4 {
            return false;
        }
        let serving = q.front().map_or(0, |w| w.round);
        let round = q
            .iter()
            .rev()
            .find(|w| w.lane == lane)
            .map_or(serving, |last| last.round + 1);
        // Behind every waiter of its round or an earlier one: never ahead of the front.
        let at = q.partition_point(|w| w.round <= round);
        q.insert(
            at,
            Waiter {
                wake: Arc::clone(me),
                since: Instant::now(),
                lane,
                round,
            },
        );
        self.len.store(q.len(), Ordering::SeqCst);
        true
    }

    fn is_front(&self, me: &Arc<Notify>) -> bool {
        self.lock()
            .front()
            .is_some_and(|w| Arc::ptr_eq(&w.wake, me))
    }

    fn remove(&self, me: &Arc<Notify>) {
        let mut q = self.lock();
        let was_front = q.front().is_some_and(|w| Arc::ptr_eq(&w.wake, me));
        q.retain(|w| !Arc::ptr_eq(&w.wake, me));
        self.len.store(q.len(), Ordering::SeqCst);
        if was_front {
            if let Some(next) = q.front() {
                next.wake.notify_one();
            }
        }
    }

    /// Runs `attempt` until it takes capacity, waiting in line (in `lane`) while it reports
    /// every unit busy. `attempt` is called again after every wake-up, so it may look at a cluster
    /// rebuilt in the meantime. Returns what it took and how long it waited.
    pub async fn admit<A: Attempt>(
        &self,
        limit: QueueLimit,
        lane: u64,
        mut attempt: impl FnMut() -> A,
    ) -> Result<(A::Taken, Duration), Rejection> {
        if self.is_empty() {
            match attempt().outcome() {
                Outcome::Taken(t) => return Ok((t, Duration::ZERO)),
                Outcome::Hopeless => return Err(Rejection::NoPeer),
                Outcome::Busy => {}
            }
        }
        let me = Arc::new(Notify::new());
        if !self.push(&me, lane, limit.max_waiting) {
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
                match attempt().outcome() {
                    Outcome::Taken(t) => return Ok((t, start.elapsed())),
                    Outcome::Hopeless => return Err(Rejection::NoPeer),
                    Outcome::Busy => {}
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

/// The waiting lines, one per key (a pool of peers: the model a request asks for), made as
/// requests of each first wait. Keys come from what peers serve, so lines are few and are
/// never removed.
#[derive(Debug)]
pub struct WaitLines<K> {
    lines: ArcSwap<Vec<(K, Arc<WaitQueue>)>>,
    /// One line made at a time, so that two requests of a new pool do not make two.
    adding: Mutex<()>,
}

impl<K> Default for WaitLines<K> {
    fn default() -> Self {
        Self {
            lines: ArcSwap::default(),
            adding: Mutex::default(),
        }
    }
}

impl<K: Copy + Eq> WaitLines<K> {
    /// The line of `key`'s requests.
    pub fn line(&self, key: K) -> Arc<WaitQueue> {
        let find = |lines: &[(K, Arc<WaitQueue>)]| {
            lines
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, line)| Arc::clone(line))
        };
        if let Some(line) = find(&self.lines.load()) {
            return line;
        }
        let _one_at_a_time = self.adding.lock().unwrap_or_else(|p| p.into_inner());
        let lines = self.lines.load_full();
        if let Some(line) = find(&lines) {
            return line;
        }
        let line = Arc::new(WaitQueue::default());
        let mut next = Vec::with_capacity(lines.len() + 1);
        next.extend(lines.iter().cloned());
        next.push((key, Arc::clone(&line)));
        self.lines.store(Arc::new(next));
        line
    }

    /// Requests waiting now, in every line.
    pub fn len(&self) -> usize {
        self.lines.load().iter().map(|(_, line)| line.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tells the front waiter of every line that capacity may have appeared: a freed slot
    /// may serve several pools (a peer that lists no model serves every one), and a front
    /// that cannot use it waits on.
    pub fn wake_fronts(&self) {
        for (_, line) in self.lines.load().iter() {
            line.wake_front();
        }
    }

    /// How long the longest-waiting front has waited, if anyone waits.
    pub fn front_waited(&self) -> Option<Duration> {
        self.lines
            .load()
            .iter()
            .filter_map(|(_, line)| line.front_waited())
            .max()
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
