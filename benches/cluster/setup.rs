//! The cluster every run is on, and what the routers are told of it.

/// Requests each simulated GPU runs at once; more wait in its queue.
pub const MAX_RUNNING: usize = 8;
pub const CACHE_TOKENS: usize = 65_536;
pub const SPEED: f64 = 2.0;
/// The simulator's prefill rate at `SPEED`: what an operator would configure.
pub const PREFILL_TOKENS_PER_SEC: f64 = 10_000.0 * SPEED;
pub const MAX_IN_FLIGHT: u32 = 32;
pub const REPLICAS: usize = 4;
pub const SEED: u64 = 20261201;
pub const SESSION_HEADER: &str = "x-session-id";
