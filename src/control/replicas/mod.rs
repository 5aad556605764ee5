//! Several prefixlb processes in front of the same peers (replicas behind a round-robin front)
//! each see only the turns of a conversation that reach them; alone, each would send a turn
//! whose earlier turns it never saw wherever its system prompt went, and the peer holding the
//! conversation would redo nothing only by chance. So each process tells the others, over UDP,
//! which peer it sent each prompt to (its block names, [`crate::routing::blocks`]), and records
//! what they tell it.
//!
//! The request path only hands a recorded prompt to a bounded queue; a thread of this service
//! packs the queue into datagrams and sends them. Nothing waits for the others and nothing is
//! acknowledged: what is lost costs a prefill, as a forgotten block does.
//!
//! What a datagram tells steers keys, so a datagram is heard only from a listed replica's
//! address and, with `replicas.key_file`, only when signed with a key of the file ([`keys`]),
//! sent lately and not heard before ([`replay`]): an address can be spoofed and a datagram
//! copied, the key cannot be guessed. Without a key (replicas on loopback alone, as the configuration
//! requires) datagrams go unsigned ([`wire`]).

pub mod keys;
pub mod replay;
pub mod wire;

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;

use crate::metrics;
use crate::router::Router;
use crate::routing::clock::unix_ms;
use crate::routing::record::Served;
use crate::settings::Replicas;
use keys::KeyRing;
use replay::Senders;
pub use wire::{encode_entry, MAGIC, MAX_DATAGRAM};

/// Prompts waiting to be sent; more are dropped (and counted).
const OUTBOX: usize = 4096;

/// The replicas' exchange, as a background service.
pub struct ReplicaExchange {
    router: Arc<Router>,
    settings: Replicas,
    /// The keys of `replicas.key_file`, kept in step with it; none: unsigned.
    keys: Option<Arc<ArcSwap<KeyRing>>>,
    /// This process's sender id in the datagrams it signs.
    sender: u64,
}

impl ReplicaExchange {
    pub fn new(
        router: Arc<Router>,
        settings: Replicas,
        keys: Option<Arc<ArcSwap<KeyRing>>>,
    ) -> Self {
        Self {
            router,
            settings,
            keys,
            sender: sender_id(),
        }
    }

    /// Records what a datagram from `from` tells, when `from` is a replica's address and the
    /// datagram is to be heard.
    fn heard(&self, datagram: &[u8], from: SocketAddr, senders: &mut Senders) {
        if !self.is_replica(from.ip()) {
            metrics::REPLICA_MESSAGES
                .with_label_values(&["refused"])
                .inc();
            return;
        }
        let body = match self.accept(datagram, senders) {
            Ok(body) => body,
            Err(event) => {
                metrics::REPLICA_MESSAGES.with_label_values(&[event]).inc();
                return;
            }
        };
        let cluster = self.router.cluster();
        for (id, hashes) in wire::entries(body) {
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

    /// The entries of a datagram to be heard; else the event it is counted as.
    fn accept<'a>(
        &self,
        datagram: &'a [u8],
        senders: &mut Senders,
    ) -> Result<&'a [u8], &'static str> {
        let Some(keys) = &self.keys else {
            return wire::unsigned(datagram).ok_or("unsigned");
        };
        let signed = wire::open(datagram, &keys.load()).map_err(|refused| match refused {
            wire::Refused::Unsigned => "unsigned",
            wire::Refused::Forged => "forged",
        })?;
        // Before the window, so that a stale copy moves no window.
        if !replay::fresh(signed.sent_ms, unix_ms(SystemTime::now())) {
            return Err("stale");
        }
        // This process's own datagrams, sent back to it, would record its choices twice.
        if signed.sender == self.sender || !senders.admit(signed.sender, signed.seq) {
            return Err("replayed");
        }
        Ok(signed.body)
    }

    fn is_replica(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.settings
            .others
            .iter()
            .any(|o| o.ip().to_canonical() == ip)
    }
}

/// A sender id that no other process is likely to draw: a process restarted must not be taken
/// for the one before it, whose sequence numbers it repeats.
fn sender_id() -> u64 {
    getrandom::u64().unwrap_or_else(|e| {
        log::warn!("replicas: no system randomness ({e}): the sender id is drawn from the clock");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        (now.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32)
    })
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

/// Where and how [`send_loop`] sends.
struct Sending {
    to: Vec<SocketAddr>,
    keys: Option<Arc<ArcSwap<KeyRing>>>,
    sender: u64,
}

/// Sends what the record hands over until the record is gone: as many prompts as are waiting
/// packed into each datagram, to every other replica.
fn send_loop(socket: UdpSocket, outbox: Receiver<Served>, router: Arc<Router>, sending: Sending) {
    let mut datagram = Vec::with_capacity(MAX_DATAGRAM);
    let mut carried = None;
    let mut seq = 0u64;
    loop {
        let Some(first) = carried.take().or_else(|| outbox.recv().ok()) else {
            return;
        };
        // The keys as they are now sign the whole datagram; a reload meanwhile signs the next.
        let ring = sending.keys.as_ref().map(|k| k.load_full());
        let signer = ring.as_ref().map(|r| r.signer());
        let signing = signer.map(|key| wire::Signing {
            key,
            sender: sending.sender,
            seq,
            sent_ms: unix_ms(SystemTime::now()),
        });
        wire::begin(&mut datagram, signing);
        let header = datagram.len();
        let cluster = router.cluster();
        let mut next = Some(first);
        while let Some(served) = next {
            // A peer gone from the cluster since is not told of.
            let peer = cluster.peers().iter().find(|p| p.serial() == served.peer);
            if let Some(peer) = peer {
                if !encode_entry(&mut datagram, peer.id(), served.blocks.hashes()) {
                    // It starts the next datagram; one it does not fit alone (a peer named in
                    // over 255 bytes) is dropped.
                    if datagram.len() > header {
                        carried = Some(served);
                    }
                    break;
                }
            }
            next = outbox.try_recv().ok();
        }
        drop(cluster);
        if datagram.len() > header {
            if let Some(key) = signer {
                wire::seal(&mut datagram, key);
                seq += 1;
            }
            for addr in &sending.to {
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
            let router = Arc::clone(&self.router);
            let sending = Sending {
                to: self.settings.others.clone(),
                keys: self.keys.clone(),
                sender: self.sender,
            };
            let spawned = std::thread::Builder::new()
                .name("prefixlb-replicas".into())
                .spawn(move || send_loop(sender, queued, router, sending));
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
            "replicas: telling {} other processes where prompts went, hearing them on udp {listen}, {}",
            self.settings.others.len(),
            match &self.keys {
                Some(keys) => format!("signed with key id {}", keys.load().signer().id()),
                None => "unsigned".into(),
            }
        );
        let mut senders = Senders::default();
        let mut buf = vec![0u8; 65_536];
        loop {
            tokio::select! {
                _ = shutdown.changed() => return,
                got = socket.recv_from(&mut buf) => match got {
                    Ok((n, from)) => self.heard(&buf[..n], from, &mut senders),
                    Err(e) => log::warn!("replicas: udp {listen}: {e}"),
                },
            }
        }
    }
}
