//! The `prefixlb` binary: Pingora's server with the routing proxy and the admin API.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use pingora::server::configuration::{Opt, ServerConf};
use pingora::server::Server;
use pingora::services::background::background_service;
use pingora::services::listening::Service;

use prefixlb::access_log::AccessLog;
use prefixlb::admin::Admin;
use prefixlb::config::Config;
use prefixlb::control::source::PeerSource;
use prefixlb::control::ControlPlane;
use prefixlb::proxy::PrefixLb;
use prefixlb::router::Router;

/// Reads the peer source once, on a runtime of its own (the DNS resolver's sockets belong to the
/// runtime they were made on, so the control plane makes its own).
fn initial_peers(
    config: &Config,
    path: &std::path::Path,
) -> Result<Vec<prefixlb::routing::PeerSpec>, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let mut source = PeerSource::from_config(config, path).map_err(|e| e.to_string())?;
        let label = source.label();
        match source.load(true).await {
            Ok(specs) => Ok(specs.unwrap_or_default()),
            Err(e) => Err(format!("{label}: {e}")),
        }
    })
}

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

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let mut cli = Cli::parse();
    // A daemon runs from /: reloads must find the files the command line meant.
    if let Ok(absolute) = std::fs::canonicalize(&cli.lb_conf) {
        cli.lb_conf = absolute;
    }
    let config = match Config::load(&cli.lb_conf) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("prefixlb: {}: {e}", cli.lb_conf.display());
            return ExitCode::FAILURE;
        }
    };
    if let Some(conf) = &cli.server.conf {
        if let Err(e) = ServerConf::load_from_yaml(conf) {
            eprintln!("prefixlb: {conf}: {e}");
            return ExitCode::FAILURE;
        }
    }
    let router = match Router::from_config(&config) {
        Ok(r) => Arc::new(r),
        Err(e) => {
            eprintln!("prefixlb: {}: {e}", cli.lb_conf.display());
            return ExitCode::FAILURE;
        }
    };
    // Peers from a peers file or DNS are there before the first request, not at the control
    // plane's first tick: after an upgrade, the new process serves at once.
    if config.discovery.peers_file.is_some() || config.discovery.dns.is_some() {
        match initial_peers(&config, &cli.lb_conf) {
            Ok(specs) => router.set_peers(&specs),
            Err(e) if config.discovery.dns.is_some() && !cli.server.test => {
                log::warn!("no peers from DNS yet, starting without: {e}");
            }
            Err(e) => {
                eprintln!("prefixlb: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if cli.server.test {
        println!("prefixlb: {} is valid", cli.lb_conf.display());
    }
    let mut server = match Server::new(Some(cli.server)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("prefixlb: {e}");
            return ExitCode::FAILURE;
        }
    };
    // With -t, Pingora exits here once its own configuration has loaded.
    server.bootstrap();

    let mut proxy = prefixlb::proxy::service::proxy_service(
        &server.configuration,
        PrefixLb::new(Arc::clone(&router), AccessLog::new(config.access_log)),
    );
    for addr in &config.listen {
        proxy.add_tcp(addr);
    }
    server.add_service(proxy);
    if let Err(e) = prefixlb::metrics::register(Arc::clone(&router)) {
        eprintln!("prefixlb: metrics: {e}");
        return ExitCode::FAILURE;
    }
    let source = match PeerSource::from_config(&config, &cli.lb_conf) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("prefixlb: {}: {e}", cli.lb_conf.display());
            return ExitCode::FAILURE;
        }
    };
    match ControlPlane::new(Arc::clone(&router), source, &config.health_check) {
        Ok(control) => {
            server.add_service(background_service("control plane", control));
        }
        Err(e) => {
            eprintln!("prefixlb: health check setup: {e}");
            return ExitCode::FAILURE;
        }
    }
    if let Some(addr) = &config.admin.listen {
        let mut admin = Service::new(
            "prefixlb admin".into(),
            Admin::new(Arc::clone(&router), config.admin.token.clone()),
        );
        admin.add_tcp(addr);
        server.add_service(admin);
    }
    log::info!(
        "prefixlb: {} peers, policy {}, listening on {}",
        router.cluster().peers().len(),
        router.balance.policy.as_str(),
        config.listen.join(", ")
    );
    server.run_forever()
}
