//! The `prefixlb` binary: Pingora's server with the routing proxy and the admin API.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use pingora::server::configuration::{Opt, ServerConf};
use pingora::server::{RunArgs, Server};
use pingora::services::background::background_service;
use pingora::services::listening::Service;

use prefixlb::admin::Admin;
use prefixlb::control::engine::EngineFeedback;
use prefixlb::control::shared_load::{Publisher, SharedLoad};
use prefixlb::control::source::PeerSource;
use prefixlb::control::ControlPlane;
use prefixlb::lifecycle::{self, Activity, Signals};
use prefixlb::proxy::PrefixLb;
use prefixlb::router::Router;
use prefixlb::settings::Discovery;

// jemalloc, measured against glibc's malloc and mimalloc (`benches/memory.rs`, `overhead.rs`):
// an open stream holds 50 KiB with it, 55 KiB with glibc and 170 KiB with mimalloc, an idle
// connection 29 KiB against 88 KiB with either; per request it costs less CPU than glibc.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser, Debug)]
#[command(
    name = "prefixlb",
    version,
    about = "Prompt-prefix-affine load balancer for LLM inference servers"
)]
struct Cli {
    /// prefixlb's own configuration: listeners, peers, routing, queue, limits, timeouts.
    #[arg(
        short = 'l',
        long = "lb-conf",
        value_name = "FILE",
        default_value = "conf/prefixlb.yaml"
    )]
    lb_conf: PathBuf,

    #[command(flatten)]
    server: Opt,
}

/// Reads the peer source once, before serving, on a runtime of its own: the control plane's
/// runtime does not exist yet.
fn initial_peers(source: &mut PeerSource) -> Result<Vec<prefixlb::routing::PeerSpec>, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let loaded = runtime.block_on(source.load(true));
    loaded
        .map(Option::unwrap_or_default)
        .map_err(|e| format!("{}: {e}", source.label()))
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    lifecycle::ignore_until_running();
    let mut cli = Cli::parse();
    // A daemon runs from /: reloads must find the files the command line meant.
    if let Ok(absolute) = std::fs::canonicalize(&cli.lb_conf) {
        cli.lb_conf = absolute;
    }
    let Err(e) = run(cli);
    eprintln!("prefixlb: {e}");
    ExitCode::FAILURE
}

/// Serves until the process is told to stop; returns only what kept it from starting.
fn run(cli: Cli) -> Result<std::convert::Infallible, String> {
    let activity = Arc::new(Activity::default());
    let lb_conf = cli.lb_conf.clone();
    let in_file = |e: &dyn std::fmt::Display| format!("{}: {e}", lb_conf.display());
    let settings = prefixlb::config::load(&lb_conf).map_err(|e| in_file(&e))?;
    let threads_given = match &cli.server.conf {
        Some(conf) => {
            ServerConf::load_from_yaml(conf).map_err(|e| format!("{conf}: {e}"))?;
            sets_threads(conf)
        }
        None => false,
    };
    let router = Arc::new(Router::new(settings.router.clone(), &settings.peers));
    let mut source = PeerSource::new(&settings.discovery, &lb_conf).map_err(|e| in_file(&e))?;
    // Peers from a peers file or DNS are there before the first request, not at the control
    // plane's first tick: after an upgrade, the new process serves at once.
    if !matches!(settings.discovery, Discovery::ConfigFile { .. }) {
        match initial_peers(&mut source) {
            Ok(specs) => {
                router.set_peers(specs);
            }
            Err(e) if matches!(settings.discovery, Discovery::Dns(_)) && !cli.server.test => {
                log::warn!("no peers from DNS yet, starting without: {e}");
            }
            Err(e) => return Err(e),
        }
    }
    if cli.server.test {
        println!("prefixlb: {} is valid", lb_conf.display());
        std::process::exit(0);
    }
    let successor = cli.server.upgrade;
    let mut server = Server::new(Some(cli.server)).map_err(|e| e.to_string())?;
    if !threads_given {
        if let Some(conf) = Arc::get_mut(&mut server.configuration) {
            conf.threads = default_threads();
        }
    }
    let upgrade_sock = PathBuf::from(&server.configuration.upgrade_sock);
    let shared = Arc::new(SharedLoad::new(
        Arc::clone(&router),
        &upgrade_sock,
        successor,
    ));
    server.add_service(background_service(
        "shared in-flight counts",
        Publisher(Arc::clone(&shared)),
    ));
    // The sockets of an upgrade are taken by a service, after daemonizing: `-u -d` returns at
    // once and leaves the daemon waiting for them, so the old process can be told to hand them
    // over next (the unit's order). Taken before `run`, they would block the launcher until the
    // old process, not yet told, sent them.
    let bootstrap = server.bootstrap_as_a_service();

    let mut proxy = prefixlb::proxy::service::proxy_service(
        &server.configuration,
        PrefixLb::new(
            Arc::clone(&router),
            settings.proxy.clone(),
            Arc::clone(&activity),
            Arc::clone(&shared),
        ),
        Arc::clone(&activity),
    );
    for addr in &settings.listen {
        proxy.add_tcp(&addr.to_string());
    }
    server.add_service(proxy).add_dependency(&bootstrap);
    prefixlb::metrics::register(Arc::clone(&router)).map_err(|e| format!("metrics: {e}"))?;
    let control = ControlPlane::new(
        Arc::clone(&router),
        source,
        settings.allow_empty_peers,
        settings.health_check.as_ref(),
    )
    .map_err(|e| format!("health check setup: {e}"))?;
    server.add_service(background_service("control plane", control));
    if let Some(engine) = &settings.engine_metrics {
        server.add_service(background_service(
            "engine metrics",
            EngineFeedback::new(Arc::clone(&router), engine.clone()),
        ));
    }
    if let Some(admin_settings) = &settings.admin {
        let mut admin = Service::new(
            "prefixlb admin".into(),
            Admin::new(Arc::clone(&router), admin_settings.token.clone()),
        );
        admin.add_tcp(&admin_settings.listen.to_string());
        server.add_service(admin).add_dependency(&bootstrap);
    }
    log::info!(
        "prefixlb: {} peers, policy {}, listening on {}",
        router.cluster().peers().len(),
        router.balance.policy.as_str(),
        listing(&settings.listen)
    );
    server.run(RunArgs {
        shutdown_signal: Box::new(Signals {
            activity,
            upgrade_sock,
            shared,
        }),
    });
    prefixlb::access_log::drain(std::time::Duration::from_secs(1));
    std::process::exit(0)
}

/// Whether Pingora's file sets `threads`; Pingora's own default (1) does not fit most machines.
fn sets_threads(conf: &str) -> bool {
    std::fs::read_to_string(conf)
        .ok()
        .and_then(|text| serde_yaml::from_str::<serde_yaml::Mapping>(&text).ok())
        .is_some_and(|m| m.contains_key("threads"))
}

/// One worker thread per CPU this process may run on (its affinity mask, a cgroup's quota).
fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn listing(addrs: &[std::net::SocketAddr]) -> String {
    addrs
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
