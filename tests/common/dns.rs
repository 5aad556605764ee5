//! A DNS server on loopback for the discovery tests, and mock upstreams on one port at
//! several loopback addresses, as a headless service's pods are.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use super::{start_upstream_on, Upstream};

/// A DNS server on loopback whose answers `answer` gives, query by query.
pub struct FakeDns {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeDns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub type DnsAnswer = Box<dyn Fn(&hickory_proto::op::Query) -> Vec<hickory_proto::rr::RData> + Send>;

pub async fn fake_dns(answer: DnsAnswer) -> FakeDns {
    use hickory_proto::op::{Message, MessageType};
    use hickory_proto::rr::Record;
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let mut buf = vec![0u8; 4096];
        loop {
            let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                return;
            };
            let Ok(query) = Message::from_vec(&buf[..n]) else {
                continue;
            };
            let mut reply = Message::response(query.metadata.id, query.metadata.op_code);
            reply.metadata.message_type = MessageType::Response;
            reply.metadata.authoritative = true;
            reply.metadata.recursion_desired = query.metadata.recursion_desired;
            reply.metadata.recursion_available = true;
            for q in &query.queries {
                reply.add_query(q.clone());
                for data in answer(q) {
                    reply.add_answer(Record::from_rdata(q.name().clone(), 0, data));
                }
            }
            if let Ok(bytes) = reply.to_vec() {
                let _ = socket.send_to(&bytes, from).await;
            }
        }
    });
    FakeDns { addr, task }
}

/// A records for `name`: whatever `ips` holds at the time of the query.
pub fn a_records(name: &str, ips: Arc<Mutex<Vec<Ipv4Addr>>>) -> DnsAnswer {
    use hickory_proto::rr::{rdata::A, Name, RData, RecordType};
    let name = Name::from_ascii(name).unwrap().to_lowercase();
    Box::new(move |q| {
        if q.query_type() != RecordType::A || q.name().to_lowercase() != name {
            return Vec::new();
        }
        ips.lock()
            .unwrap()
            .iter()
            .map(|ip| RData::A(A(*ip)))
            .collect()
    })
}

/// Mock upstreams "a", "b", ... at 127.0.0.1, 127.0.0.2, ... on one port, as a headless
/// service's pods are.
pub async fn upstreams_on_one_port<const N: usize>() -> (u16, [Upstream; N]) {
    let first = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = first.local_addr().unwrap().port();
    let mut ups = vec![start_upstream_on("a", first).await];
    for i in 1..N {
        let ip = std::net::Ipv4Addr::new(127, 0, 0, i as u8 + 1);
        let name = ((b'a' + i as u8) as char).to_string();
        let listener = tokio::net::TcpListener::bind((ip, port)).await.unwrap();
        ups.push(start_upstream_on(&name, listener).await);
    }
    let ups = ups
        .try_into()
        .unwrap_or_else(|_| unreachable!("N upstreams were started"));
    (port, ups)
}
