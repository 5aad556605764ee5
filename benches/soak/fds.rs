//! A process's open descriptors, told apart: its TCP connections come and go with the load
//! (clients' keep-alive connections, the upstream pool, which kills and peer changes move by a
//! tenth), while what else it holds (files, pipes, event descriptors, listeners, other
//! sockets) should not move at all; a connection left half-closed (CLOSE_WAIT) is one never
//! closed.

use std::collections::HashMap;

use serde::Serialize;

/// Open descriptors of a process.
pub fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// A TCP socket a process holds.
#[derive(Clone)]
struct Tcp {
    /// The kernel's state code: `01` established, `08` CLOSE_WAIT, `0A` listening.
    state: String,
    local_port: u16,
    remote_port: u16,
}

/// Every descriptor of `pid`: its TCP sockets, and how many others.
fn descriptors(pid: u32) -> (Vec<Tcp>, usize) {
    let mut sockets: Vec<u64> = Vec::new();
    let mut others = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = std::fs::read_link(entry.path()).unwrap_or_default();
        let inode = target
            .to_string_lossy()
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse::<u64>().ok());
        match inode {
            Some(inode) => sockets.push(inode),
            None => others += 1,
        }
    }
    // The process's network namespace's tables, by inode; sockets not in them are Unix or UDP.
    let mut tcp: HashMap<u64, Tcp> = HashMap::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(remote), Some(state), Some(inode)) =
                (f.get(1), f.get(2), f.get(3), f.get(9))
            else {
                continue;
            };
            let port = |addr: &str| {
                addr.rsplit(':')
                    .next()
                    .and_then(|p| u16::from_str_radix(p, 16).ok())
                    .unwrap_or(0)
            };
            if let Ok(inode) = inode.parse() {
                tcp.insert(
                    inode,
                    Tcp {
                        state: (*state).to_owned(),
                        local_port: port(local),
                        remote_port: port(remote),
                    },
                );
            }
        }
    }
    // A socket may be held under several descriptors (prefixlb duplicates an upstream one
    // to watch a stream): each counts as the kind of socket it is.
    let mut held = Vec::new();
    for inode in sockets {
        match tcp.get(&inode) {
            Some(t) => held.push(t.clone()),
            None => others += 1,
        }
    }
    (held, others)
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Fds {
    pub total: usize,
    pub tcp_established: usize,
    pub tcp_close_wait: usize,
    /// TCP sockets in any other state: listening, closing.
    pub tcp_other: usize,
    /// Everything but TCP sockets.
    pub other: usize,
}

impl Fds {
    pub fn of(pid: u32) -> Self {
        let (tcp, other) = descriptors(pid);
        let count = |state: &str| tcp.iter().filter(|t| t.state == state).count();
        let (established, close_wait) = (count("01"), count("08"));
        Self {
            total: tcp.len() + other,
            tcp_established: established,
            tcp_close_wait: close_wait,
            tcp_other: tcp.len() - established - close_wait,
            other,
        }
    }

    /// What does not follow the load: descriptors other than TCP connections.
    pub fn held(&self) -> usize {
        self.other + self.tcp_other
    }
}

/// The connections a process holds, by what they are to it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Connections {
    /// Accepted on the proxy listener.
    pub clients: usize,
    /// Accepted on the admin listener.
    pub admin: usize,
    /// Made to an engine.
    pub upstream: usize,
    pub other: usize,
    pub close_wait: usize,
}

impl Connections {
    pub fn of(pid: u32, listen_port: u16, admin_port: u16, engine_ports: &[u16]) -> Self {
        let mut c = Self::default();
        for t in descriptors(pid).0 {
            match t.state.as_str() {
                "01" if t.local_port == listen_port => c.clients += 1,
                "01" if t.local_port == admin_port => c.admin += 1,
                "01" if engine_ports.contains(&t.remote_port) => c.upstream += 1,
                "01" => c.other += 1,
                "08" => c.close_wait += 1,
                _ => {}
            }
        }
        c
    }
}
