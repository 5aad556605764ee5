//! Milliseconds on one monotonic clock for the whole process: a time kept in an atomic (an
//! ejection's end, a peer's or a stream's last byte) is a count on it. And the wall clock, in
//! milliseconds since the Unix epoch, for times other processes read.

use std::sync::LazyLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the clock's first reading.
pub fn now_ms() -> u64 {
    static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
    EPOCH.elapsed().as_millis() as u64
}

/// `at` in milliseconds since the Unix epoch (0 before it): what processes apart, on one host
/// or several kept in step, agree on.
pub fn unix_ms(at: SystemTime) -> u64 {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}
