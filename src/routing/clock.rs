//! Milliseconds on one monotonic clock for the whole process: a time kept in an atomic (an
//! ejection's end, a peer's or a stream's last byte) is a count on it.

use std::sync::LazyLock;
use std::time::Instant;

/// Milliseconds since the clock's first reading.
pub fn now_ms() -> u64 {
    static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);
    EPOCH.elapsed().as_millis() as u64
}
