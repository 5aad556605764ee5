//! What the control plane asks of the peers and of other prefixlb processes: health checks,
//! the engines' metrics, their model lists, and the replicas told where prompts went.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The other prefixlb processes in front of the same peers, told where prompts went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replicas {
    /// Where this process hears the others (UDP).
    pub listen: SocketAddr,
    /// Where the others hear (UDP).
    pub others: Vec<SocketAddr>,
    /// The keys datagrams are signed with; none: unsigned, which only loopback allows.
    pub key_file: Option<PathBuf>,
}

/// Asking each peer that lists no models which it serves (`GET /v1/models`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelDiscovery {
    pub interval: Duration,
    pub timeout: Duration,
}

impl ModelDiscovery {
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
}

/// Active checks: an HTTP GET per peer per interval; a peer flips after so many results in a
/// row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub healthy_after: usize,
    pub unhealthy_after: usize,
}

/// Reading each engine's Prometheus endpoint for its running and waiting requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineMetrics {
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self {
            path: "/metrics".into(),
            interval: Duration::from_millis(200),
            timeout: Duration::from_millis(150),
        }
    }
}

impl Default for HealthCheck {
    fn default() -> Self {
        Self {
            path: "/health".into(),
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            healthy_after: 2,
            unhealthy_after: 2,
        }
    }
}
