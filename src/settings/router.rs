//! The router's settings: routing keys, balance, ring, outlier ejection and the prefix record.

use crate::routing::{Balance, KeyConfig, OutlierPolicy, RingConfig};

/// How the router routes.
#[derive(Debug, Clone)]
pub struct RouterSettings {
    pub keys: KeyConfig,
    pub balance: Balance,
    pub ring: RingConfig,
    pub outlier: OutlierPolicy,
    /// Memory of the record of where prompt blocks went.
    pub record_bytes: usize,
}

impl Default for RouterSettings {
    fn default() -> Self {
        Self {
            keys: KeyConfig::default(),
            balance: Balance::default(),
            ring: RingConfig::default(),
            outlier: OutlierPolicy::default(),
            record_bytes: crate::routing::record::DEFAULT_BYTES,
        }
    }
}
