//! The small conversions the sections' defaults share.

use std::time::Duration;

use crate::routing::Weight;

pub fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

pub fn weight_one() -> u32 {
    Weight::ONE.get()
}
