//! Prometheus metrics, in the default registry that pingora-prometheus serves.
//!
//! Per-peer gauges (in flight, bound, health, drain, ejection) are read from the live cluster
//! at scrape time, so they cannot drift from the state the router acts on; counters and
//! histograms are updated on the request path.
//!
//! `counters` holds the counters and histograms (a leaf: any module may count), `collect` the
//! gauges read from the router and the tenants at each scrape.

mod collect;
pub mod counters;

pub use collect::register;
pub use counters::*;
