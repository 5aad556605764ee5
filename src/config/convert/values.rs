//! Checks of single values, each error naming its field.

use std::net::SocketAddr;
use std::time::Duration;

use crate::config::error::ConfigError;
use crate::routing::{Weight, MAX_WEIGHT, UNLIMITED};

pub fn at_least_one(field: &str, n: u64) -> Result<(), ConfigError> {
    if n == 0 {
        return Err(ConfigError::new(field, "must be at least 1"));
    }
    Ok(())
}

pub fn millis(field: &str, ms: u64) -> Result<Duration, ConfigError> {
    at_least_one(field, ms)?;
    Ok(Duration::from_millis(ms))
}

pub fn socket_addr(field: &str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse()
        .map_err(|e| ConfigError::new(field, format!("`{text}` is not ip:port ({e})")))
}

pub fn weight(field: &str, w: u32) -> Result<Weight, ConfigError> {
    Weight::new(w).ok_or_else(|| ConfigError::new(field, format!("must be from 1 to {MAX_WEIGHT}")))
}

/// `None` is no ceiling; 0 is refused rather than read as "nothing may run".
pub fn ceiling(field: &str, max: Option<u32>) -> Result<u32, ConfigError> {
    match max {
        Some(0) => Err(ConfigError::new(
            field,
            "must be at least 1 (omit it for no ceiling)",
        )),
        Some(n) => Ok(n),
        None => Ok(UNLIMITED),
    }
}

pub fn path(field: &str, p: &str) -> Result<(), ConfigError> {
    if !p.starts_with('/') {
        return Err(ConfigError::new(field, format!("`{p}` must start with /")));
    }
    Ok(())
}

/// A share: a number from 0 to 1.
pub fn share(field: &str, x: f64) -> Result<f64, ConfigError> {
    if !(x.is_finite() && (0.0..=1.0).contains(&x)) {
        return Err(ConfigError::new(
            field,
            format!("must be a number from 0 to 1, not {x}"),
        ));
    }
    Ok(x)
}

/// A count that may be fractional: a finite number ≥ 0.
pub fn non_negative(field: &str, x: f64) -> Result<f64, ConfigError> {
    if !(x.is_finite() && x >= 0.0) {
        return Err(ConfigError::new(
            field,
            format!("must be a number ≥ 0, not {x}"),
        ));
    }
    Ok(x)
}
