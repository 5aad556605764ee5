//! The floor prefixlb is measured against in `benches/overhead.rs`: a Pingora proxy that only
//! picks an upstream (round robin), built and tuned as prefixlb is (allocator, threads from
//! Pingora's file, the same upstream connection pool, the same listener buffers).
//!
//! `cargo run --release --example bare_proxy -- --listen 127.0.0.1:8081 --upstream 127.0.0.1:8000 -c conf/pingora.yaml`

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_trait::async_trait;
use clap::Parser;
use pingora::listeners::{L4BufferSettings, ListenerConfig};
use pingora::prelude::*;
use pingora::server::configuration::Opt;

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
struct Cli {
    #[arg(long)]
    listen: SocketAddr,
    #[arg(long, required = true)]
    upstream: Vec<SocketAddr>,
    #[command(flatten)]
    server: Opt,
}

struct Bare {
    upstreams: Vec<SocketAddr>,
    next: AtomicUsize,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) {}

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.upstreams.len();
        Ok(Box::new(HttpPeer::new(
            self.upstreams[i],
            false,
            String::new(),
        )))
    }
}

fn main() {
    let cli = Cli::parse();
    let mut server = Server::new(Some(cli.server)).expect("Pingora's settings");
    server.bootstrap();
    let mut proxy = pingora::proxy::http_proxy_service(
        &server.configuration,
        Bare {
            upstreams: cli.upstream,
            next: AtomicUsize::new(0),
        },
    );
    // As prefixlb's plain listeners: no L4 read buffer in front of Pingora's own header and
    // body buffers.
    proxy.add_listener(
        ListenerConfig::tcp(cli.listen.to_string()).l4_buffer(L4BufferSettings::default().read(0)),
    );
    server.add_service(proxy);
    server.run_forever();
}
