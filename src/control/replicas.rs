//! Several prefixlb processes in front of the same peers (replicas behind a round-robin front)
//! each see only the turns of a conversation that reach them; alone, each would send a turn
//! whose earlier turns it never saw wherever its system prompt went, and the peer holding the
//! conversation would redo nothing only by chance. So each process tells the others, over UDP,
//! which peer it sent each prompt to (its block names, [`crate::routing::blocks`]), and records
//! what they tell it.
//!
//! The request path only hands a recorded prompt to a bounded queue; a thread of this service
//! packs the queue into datagrams and sends them. Nothing waits for the others and nothing is
//! acknowledged: what is lost costs a prefill, as a forgotten block does. Datagrams from an
//! address that is not a listed replica's are dropped, so a stray sender cannot steer keys.
//!
//! A datagram is [`MAGIC`] then entries, each: the peer's address as text (a length byte,
//! then the bytes; every process names peers by the address its configuration gives), a count
//! byte, then that many block names, little-endian `u64`, shallowest first.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::metrics;
use crate::router::Router;
use crate::routing::record::Served;
use crate::settings::Replicas;

/// The first bytes of every datagram: its format, version 1.
pub const MAGIC: &[u8; 4] = b"PLR1";

/// Bytes of a datagram at most, entries included whole: one Ethernet frame's payload, so that
/// nothing is fragmented between hosts.
pub const MAX_DATAGRAM: usize = 1400;

/// Prompts waiting to be sent; more are dropped (and counted).
const OUTBOX: usize = 4096;

/// Appends one entry to `out`, unless it would pass [`MAX_DATAGRAM`]; false then.
pub fn encode_entry(out: &mut Vec<u8>, peer: &str, hashes: &[u64]) -> bool {
    let (Ok(id_len), Ok(n)) = (u8::try_from(peer.len()), u8::try_from(hashes.len())) else {
        return false;
    };
    let size = 2 + peer.len() + 8 * hashes.len();
    if out.len() + size > MAX_DATAGRAM {
        return false;
    }
    out.push(id_len);
    out.extend_from_slice(peer.as_bytes());
    out.push(n);
    for h in hashes {
        out.extend_from_slice(&h.to_le_bytes());
    }
    true
}

/// The entries of a datagram, in order, up to the first that is cut short or not text; none
/// without [`MAGIC`].
pub fn decode(datagram: &[u8]) -> impl Iterator<Item = (&str, Vec<u64>)> {
    let mut rest = datagram.strip_prefix(MAGIC.as_slice()).unwrap_or_default();
    std::iter::from_fn(move || {
        let (&id_len, tail) = rest.split_first()?;
        let (id, tail) = tail.split_at_checked(usize::from(id_len))?;
        let id = std::str::from_utf8(id).ok()?;
        let (&n, tail) = tail.split_first()?;
        let (names, tail) = tail.split_at_checked(8 * usize::from(n))?;
        rest = tail;
        let hashes = names
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
            .collect();
        Some((id, hashes))
    })
}

/// The replicas' exchange, as a background service.
pub struct ReplicaExchange {
    router: Arc<Router>,
    settings: Replicas,
}

impl ReplicaExchange {
    pub fn new(router: Arc<Router>, settings: Replicas) -> Self {
        Self { router, settings }
    }

    /// Records what a datagram from `from` tells, when `from` is a replica's address.
    fn heard(&self, datagram: &[u8], from: SocketAddr) {
        if !self.is_replica(from.ip()) {
            metrics::REPLICA_MESSAGES
                .with_label_values(&["refused"])
                .inc();
            return;
        }
        let cluster = self.router.cluster();
        for (id, hashes) in decode(datagram) {
            // A peer this process does not have (yet, or any more) is skipped.
            let Some(peer) = cluster.peer(id) else {
                continue;
            };
            cluster.record().record_heard(&hashes, peer.serial());
            metrics::REPLICA_MESSAGES
                .with_label_values(&["heard"])
                .inc();
        }
    }

    fn is_replica(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.settings
            .others
            .iter()
            .any(|o| o.ip().to_canonical() == ip)
    }
}

/// Binds `addr` so that the process taking over in an upgrade can bind it too while this one
/// finishes: each then hears a share of the datagrams, until this one exits.
fn bind_shared(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, None)?;
    socket.set_reuse_port(true)?;
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// Sends what the record hands over until the record is gone: as many prompts as are waiting
/// packed into each datagram, to every other replica.
fn send_loop(
    socket: UdpSocket,
    outbox: Receiver<Served>,
    router: Arc<Router>,
    to: Vec<SocketAddr>,
) {
    let mut datagram = Vec::with_capacity(MAX_DATAGRAM);
    let mut carried = None;
    loop {
        let Some(first) = carried.take().or_else(|| outbox.recv().ok()) else {
            return;
        };
        datagram.clear();
        datagram.extend_from_slice(MAGIC);
        let cluster = router.cluster();
        let mut next = Some(first);
        while let Some(served) = next {
            // A peer gone from the cluster since is not told of.
            let peer = cluster.peers().iter().find(|p| p.serial() == served.peer);
            if let Some(peer) = peer {
                if !encode_entry(&mut datagram, peer.id(), served.blocks.hashes()) {
                    // It starts the next datagram; one it does not fit alone (a peer named in
                    // over 255 bytes) is dropped.
                    if datagram.len() > MAGIC.len() {
                        carried = Some(served);
                    }
                    break;
                }
            }
            next = outbox.try_recv().ok();
        }
        drop(cluster);
        if datagram.len() > MAGIC.len() {
            for addr in &to {
                // A lost datagram costs prefills, not errors: a replica down is not this
                // one's problem, and the next prompts try again.
                let _ = socket.send_to(&datagram, addr);
            }
            metrics::REPLICA_MESSAGES.with_label_values(&["sent"]).inc();
        }
    }
}

#[async_trait]
impl BackgroundService for ReplicaExchange {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let listen = self.settings.listen;
        let socket = loop {
            match bind_shared(listen) {
                Ok(s) => break s,
                Err(e) => {
                    log::error!("replicas: cannot listen on udp {listen}: {e}; again in 5 s");
                    tokio::select! {
                        _ = shutdown.changed() => return,
                        _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                    }
                }
            }
        };
        let sender = match socket.try_clone() {
            Ok(s) => s,
            Err(e) => {
                log::error!("replicas: udp {listen}: {e}; not telling the other replicas");
                return;
            }
        };
        let (outbox, queued) = sync_channel(OUTBOX);
        if self.router.cluster().record().share(outbox) {
            let (router, to) = (Arc::clone(&self.router), self.settings.others.clone());
            let spawned = std::thread::Builder::new()
                .name("prefixlb-replicas".into())
                .spawn(move || send_loop(sender, queued, router, to));
            if let Err(e) = spawned {
                log::error!("replicas: no thread to send with: {e}");
            }
        }
        let socket = match socket
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UdpSocket::from_std(socket))
        {
            Ok(s) => s,
            Err(e) => {
                log::error!("replicas: udp {listen}: {e}; not hearing the other replicas");
                return;
            }
        };
        log::info!(
            "replicas: telling {} other processes where prompts went, hearing them on udp {listen}",
            self.settings.others.len()
        );
        let mut buf = vec![0u8; 65_536];
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                got = socket.recv_from(&mut buf) => match got {
                    Ok((n, from)) => self.heard(&buf[..n], from),
                    Err(e) => log::warn!("replicas: udp {listen}: {e}"),
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn entries_come_back_as_written() {
        let mut d = MAGIC.to_vec();
        assert!(encode_entry(&mut d, "10.0.0.1:8000", &[1, u64::MAX, 3]));
        assert!(encode_entry(&mut d, "[::1]:8001", &[]));
        let got: Vec<_> = decode(&d).collect();
        assert_eq!(
            got,
            vec![
                ("10.0.0.1:8000", vec![1, u64::MAX, 3]),
                ("[::1]:8001", vec![])
            ]
        );
    }

    #[test]
    fn an_entry_that_would_pass_the_datagram_size_is_left_for_the_next() {
        let mut d = MAGIC.to_vec();
        let names = [7u64; 65];
        assert!(encode_entry(&mut d, "10.0.0.1:8000", &names));
        assert!(encode_entry(&mut d, "10.0.0.1:8000", &names));
        let full = d.len();
        assert!(!encode_entry(&mut d, "10.0.0.1:8000", &names));
        assert_eq!(d.len(), full, "nothing of the refused entry was written");
        assert!(d.len() <= MAX_DATAGRAM);
    }

    #[test]
    fn a_datagram_without_the_magic_or_cut_short_yields_what_is_whole() {
        assert_eq!(decode(b"PLR0\x01a\x00").count(), 0);
        let mut d = MAGIC.to_vec();
        encode_entry(&mut d, "a:1", &[5]);
        encode_entry(&mut d, "b:2", &[6, 7]);
        d.truncate(d.len() - 3);
        let got: Vec<_> = decode(&d).collect();
        assert_eq!(got, vec![("a:1", vec![5])]);
    }

    proptest! {
        #[test]
        fn any_bytes_decode_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let mut d = MAGIC.to_vec();
            d.extend_from_slice(&bytes);
            for (id, hashes) in decode(&d) {
                prop_assert!(id.len() < 256 && hashes.len() < 256);
            }
        }
    }
}
