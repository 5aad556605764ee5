//! Several prefixlb processes that tell each other where prompts went: their UDP addresses, and
//! the settings that make a process one of them.

use std::net::SocketAddr;
use std::path::Path;

use serde_yaml::Value;

use super::{text, TestConfig};

/// What one of several prefixlb processes that tell each other where prompts went is told:
/// the UDP address it listens on and those of the others.
#[derive(Clone, Debug)]
pub struct Replica {
    pub listen: SocketAddr,
    pub others: Vec<SocketAddr>,
}

/// The replica settings of `n` processes, on loopback UDP ports free when looked up.
pub fn replicas(n: usize) -> Vec<Replica> {
    // All held until all are known, so that no two are the same.
    let sockets: Vec<_> = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    let addrs: Vec<SocketAddr> = sockets.iter().map(|s| s.local_addr().unwrap()).collect();
    addrs
        .iter()
        .map(|&listen| Replica {
            listen,
            others: addrs.iter().copied().filter(|a| *a != listen).collect(),
        })
        .collect()
}

impl TestConfig {
    pub fn replica(self, replica: &Replica) -> Self {
        let others: Vec<Value> = replica.others.iter().map(text).collect();
        self.set(&["replicas", "listen"], text(replica.listen))
            .set(&["replicas", "others"], Value::Sequence(others))
    }

    /// `replicas.key_file`: the keys the replicas sign their datagrams with.
    pub fn replica_key_file(self, path: &Path) -> Self {
        self.set(&["replicas", "key_file"], text(path.display()))
    }
}
