//! The floor prefixlb is measured against in `benches/overhead/` and `benches/memory.rs`: a
//! Pingora proxy that only picks an upstream (round robin), built and set up as prefixlb is with
//! its defaults: the allocator, the log level (`info`), Pingora's defaults prefixlb applies when
//! `pingora.yaml` is silent (threads, fast-timer limit), the upstream timeouts, the client write
//! timeout, the same upstream connection pool, the same listener buffers and the same modules.
//!
//! `cargo run --release --example bare_proxy -- --listen 127.0.0.1:8081 --upstream 127.0.0.1:8000 -c conf/pingora.yaml`

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use clap::Parser;
use pingora::listeners::{L4BufferSettings, ListenerConfig};
use pingora::prelude::*;
use pingora::server::configuration::Opt;
use prefixlb::server::pingora_defaults;
use prefixlb::settings::ProxySettings;

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
    /// prefixlb's defaults: the client write timeout and the upstream timeouts.
    settings: ProxySettings,
}

#[async_trait]
impl ProxyHttp for Bare {
    type CTX = ();

    fn new_ctx(&self) {}

    // As prefixlb: no response-compression module (Pingora adds a disabled one by default).
    fn init_downstream_modules(&self, _modules: &mut pingora::modules::http::HttpModules) {}

    async fn request_filter(&self, session: &mut Session, _ctx: &mut ()) -> Result<bool> {
        session.set_write_timeout(Some(self.settings.client_write_timeout));
        Ok(false)
    }

    async fn upstream_peer(&self, _session: &mut Session, _ctx: &mut ()) -> Result<Box<HttpPeer>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.upstreams.len();
        let mut peer = HttpPeer::new(self.upstreams[i], false, String::new());
        self.settings.upstream.apply_to(&mut peer.options);
        Ok(Box::new(peer))
    }
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    let file = cli.server.conf.clone();
    let mut server = Server::new(Some(cli.server)).expect("Pingora's settings");
    let conf = Arc::get_mut(&mut server.configuration).expect("settings not shared yet");
    pingora_defaults(file.as_deref(), conf);
    server.bootstrap();
    let mut proxy = pingora::proxy::http_proxy_service(
        &server.configuration,
        Bare {
            upstreams: cli.upstream,
            next: AtomicUsize::new(0),
            settings: ProxySettings::default(),
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
