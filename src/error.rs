//! The crate's error: an input prefixlb cannot use (an API keys file, a certificate, a peer list,
//! a file it cannot read), named by where in it the fault is, with the reason.
//!
//! Configuration has its own error ([`crate::config::ConfigError`]), which converts into this
//! one; this one sits below every module, so that none has to import the configuration to fail.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    /// Where the fault is, as `keys[2]` or `tls.cert`; empty for the input as a whole.
    pub field: String,
    pub reason: String,
}

impl Error {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_located(f, &self.field, &self.reason)
    }
}

/// `field: reason`, or the reason alone for an input as a whole: how the crate's error and the
/// configuration's name a fault alike.
pub(crate) fn write_located(f: &mut fmt::Formatter<'_>, field: &str, reason: &str) -> fmt::Result {
    if field.is_empty() {
        f.write_str(reason)
    } else {
        write!(f, "{field}: {reason}")
    }
}

impl std::error::Error for Error {}
