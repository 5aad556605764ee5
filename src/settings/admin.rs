//! Where the admin API listens and what it asks of a caller.

use std::net::SocketAddr;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminSettings {
    /// Loopback by default: the admin API can drain peers.
    pub listen: SocketAddr,
    /// When set, every admin request but `/metrics` and the status page's HTML (`GET /`) must
    /// carry `Authorization: Bearer <token>`.
    pub token: Option<String>,
}

impl Default for AdminSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            token: None,
        }
    }
}
