//! Pingora's own settings file, as the spawner writes it beside prefixlb's.

use std::path::Path;

use serde_yaml::{Mapping, Value};

use super::{set, text};

/// Pingora's own settings.
#[derive(Clone, Debug)]
pub struct PingoraConfig(Mapping);

impl Default for PingoraConfig {
    fn default() -> Self {
        let mut map = Mapping::new();
        set(&mut map, &["version"], 1.into());
        Self(map)
    }
}

impl PingoraConfig {
    pub fn new() -> Self {
        Self::default()
    }

    fn set(mut self, key: &str, value: impl Into<Value>) -> Self {
        set(&mut self.0, &[key], value.into());
        self
    }

    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(&self.0).unwrap()
    }

    pub fn has_threads(&self) -> bool {
        self.0.contains_key("threads")
    }

    pub fn threads(self, n: u32) -> Self {
        self.set("threads", n)
    }

    /// How long an old process keeps serving after an upgrade or a graceful stop, and how long
    /// its final shutdown may take.
    pub fn grace_seconds(self, period: u64, shutdown_timeout: u64) -> Self {
        self.set("grace_period_seconds", period)
            .set("graceful_shutdown_timeout_seconds", shutdown_timeout)
    }

    pub fn pid_file(self, path: &Path) -> Self {
        self.set("pid_file", text(path.display()))
    }

    pub fn upgrade_sock(self, path: &Path) -> Self {
        self.set("upgrade_sock", text(path.display()))
    }
}
