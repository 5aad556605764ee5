//! The floor prefixlb is measured against in `benches/overhead/` and `benches/memory.rs`: a
//! Pingora proxy that only picks an upstream (round robin), built and set up as prefixlb is with
//! its defaults: the allocator, the log level (`info`), Pingora's defaults prefixlb applies when
//! `pingora.yaml` is silent (threads, fast-timer limit), the upstream timeouts, the client write
//! timeout, the same upstream connection pool and the same listener buffers.
//!
//! `cargo run --release --example bare_proxy -- --listen 127.0.0.1:8081 --upstream 127.0.0.1:8000 -c conf/pingora.yaml`

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

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

    async fn request_filter(&self, session: &mut Session, _ctx: &mut ()) -> Result<bool> {
        // prefixlb's `proxy.client_write_timeout_ms` default.
        session.set_write_timeout(Some(Duration::from_secs(30)));
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.upstreams.len();
        let mut peer = HttpPeer::new(self.upstreams[i], false, String::new());
        // prefixlb's `upstream.*` defaults, set on its peers as here (src/proxy/upstream.rs).
        let o = &mut peer.options;
        o.connection_timeout = Some(Duration::from_secs(3));
        o.total_connection_timeout = Some(Duration::from_secs(3));
        o.read_timeout = Some(Duration::from_secs(600));
        o.write_timeout = Some(Duration::from_secs(60));
        o.idle_timeout = Some(Duration::from_secs(4));
        Ok(Box::new(peer))
    }
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    let given: serde_yaml::Mapping = cli
        .server
        .conf
        .as_deref()
        .and_then(|conf| serde_yaml::from_str(&std::fs::read_to_string(conf).ok()?).ok())
        .unwrap_or_default();
    let mut server = Server::new(Some(cli.server)).expect("Pingora's settings");
    // What prefixlb sets when Pingora's file is silent (src/server.rs): a worker thread per CPU,
    // and timeouts over 5 s on Tokio's timer rather than Pingora's uncancellable fast one.
    let conf = Arc::get_mut(&mut server.configuration).expect("settings not shared yet");
    if !given.contains_key("threads") {
        conf.threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    }
    if !given.contains_key("fast_timeout_to_tokio_threshold_seconds") {
        conf.fast_timeout_to_tokio_threshold_seconds = Some(5);
    }
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
