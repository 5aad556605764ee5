//! A configuration error: the field and the reason.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where in the file, as `section.field` or `peers[2].addr`; empty for the file as a whole.
    pub field: String,
    pub reason: String,
}

impl ConfigError {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        crate::error::write_located(f, &self.field, &self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// Outside the configuration, a configuration error is the crate's error at the same field.
impl From<ConfigError> for crate::error::Error {
    fn from(e: ConfigError) -> Self {
        Self::new(e.field, e.reason)
    }
}

/// An input the configuration reads (a CA bundle) fails at the field that names it.
impl From<crate::error::Error> for ConfigError {
    fn from(e: crate::error::Error) -> Self {
        Self::new(e.field, e.reason)
    }
}
