//! prefixlb's settings for what it learns of engines apart from the requests: their metrics
//! pages, their health checks, and ejecting those that fail.

use super::TestConfig;

impl TestConfig {
    // Engine metrics and health.

    pub fn has_engine_metrics(&self) -> bool {
        self.has("engine_metrics")
    }

    pub fn engine_metrics(self, enabled: bool) -> Self {
        self.set(&["engine_metrics", "enabled"], enabled)
    }

    pub fn engine_metrics_interval_ms(self, ms: u64) -> Self {
        self.set(&["engine_metrics", "interval_ms"], ms)
    }

    pub fn no_health_check(self) -> Self {
        self.set(&["health_check", "enabled"], false)
    }

    pub fn health_check_interval_ms(self, ms: u64) -> Self {
        self.set(&["health_check", "interval_ms"], ms)
    }

    pub fn health_check_timeout_ms(self, ms: u64) -> Self {
        self.set(&["health_check", "timeout_ms"], ms)
    }

    pub fn healthy_after(self, n: u32) -> Self {
        self.set(&["health_check", "healthy_after"], n)
    }

    pub fn unhealthy_after(self, n: u32) -> Self {
        self.set(&["health_check", "unhealthy_after"], n)
    }

    pub fn consecutive_failures(self, n: u32) -> Self {
        self.set(&["outlier", "consecutive_failures"], n)
    }

    /// The first ejection's length and the longest one's.
    pub fn ejection_ms(self, base: u64, max: u64) -> Self {
        self.set(&["outlier", "base_ejection_ms"], base)
            .set(&["outlier", "max_ejection_ms"], max)
    }

    pub fn max_ejected_percent(self, percent: u32) -> Self {
        self.set(&["outlier", "max_ejected_percent"], percent)
    }
}
