//! What the shared router set-up (`benches/cluster/routers.rs`) is told of these engines.

/// Slots each `llama-server` runs at once (`-np 2` in the harness): the routers' balance
/// thresholds are scaled to it.
pub const MAX_RUNNING: usize = 2;
pub const MAX_IN_FLIGHT: u32 = 32;
/// One prefixlb process here: the replicated rows of the cluster bench are not run.
pub const REPLICAS: usize = 1;
pub const SESSION_HEADER: &str = "x-session-id";
/// llama.cpp serves no `/v1/loads`.
pub const ENGINE_LOADS: bool = false;
