//! `prefixlb-agent`: runs next to one inference engine and keeps its node in the Redis
//! registry that prefixlb reads (`discovery.redis`). While the engine's health endpoint answers
//! 200, the node's key is written every interval with a time to live a few intervals long; when
//! it does not, or on SIGTERM/SIGINT (stop) or SIGUSR1 (drain), the key is deleted, so prefixlb
//! stops sending new requests there within its own interval. A node whose agent dies leaves
//! when the key expires.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use pingora::upstreams::peer::HttpPeer;
use tokio::signal::unix::{signal, SignalKind};

use prefixlb::control::probe::Probe;
use prefixlb::control::registry::{Heartbeat, RegistryEntry};
use prefixlb::routing::MAX_WEIGHT;
use prefixlb::settings::{Registry, UpstreamTls};

#[derive(Parser, Debug)]
#[command(
    name = "prefixlb-agent",
    version,
    about = "Keeps an inference engine in prefixlb's Redis registry while it is healthy"
)]
struct Cli {
    /// The registry: redis://[user:password@]host:port[/db], or rediss:// for TLS.
    #[arg(long)]
    redis: String,
    /// The engine this agent watches, ip:port.
    #[arg(long)]
    engine: SocketAddr,
    /// The address prefixlb should reach the engine at; the engine's own when absent.
    #[arg(long)]
    advertise: Option<SocketAddr>,
    /// The engine's share of keys and load, as a peer's `weight` in prefixlb (1 to 100).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_WEIGHT)))]
    weight: u32,
    /// The most requests prefixlb sends the engine at once, as a peer's `max_in_flight`.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_in_flight: Option<u32>,
    /// The models (and LoRA adapters) the engine serves, comma-separated; absent: prefixlb
    /// asks the engine's /v1/models.
    #[arg(long, value_delimiter = ',')]
    models: Option<Vec<String>>,
    #[arg(long, default_value = "/health")]
    health_path: String,
    /// How often the engine is checked and the key written.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    interval_ms: u64,
    /// How long the key lives unless written again: a few intervals, so that one slow write
    /// does not drop the node.
    #[arg(long, default_value_t = 3000)]
    ttl_ms: u64,
    #[arg(long, default_value = Registry::DEFAULT_PREFIX)]
    prefix: String,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("prefixlb-agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prefixlb-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    if cli.ttl_ms <= cli.interval_ms {
        return Err("--ttl-ms must be longer than --interval-ms".into());
    }
    let advertise = cli.advertise.unwrap_or(cli.engine).to_string();
    let entry = RegistryEntry {
        weight: cli.weight,
        max_in_flight: cli.max_in_flight,
        models: cli.models.clone(),
    };
    let ttl = Duration::from_millis(cli.ttl_ms);
    let interval = Duration::from_millis(cli.interval_ms);
    let mut heartbeat = Heartbeat::new(&cli.redis, &cli.prefix, &advertise, &entry, ttl)
        .map_err(|e| e.to_string())?;
    pingora::tls::install_default_crypto_provider();
    let probe = Probe::new(UpstreamTls::default());
    let host = cli.engine.to_string();
    let mut stop = signal(SignalKind::terminate()).map_err(|e| e.to_string())?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(|e| e.to_string())?;
    let mut drain = signal(SignalKind::user_defined1()).map_err(|e| e.to_string())?;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // What was last done, so that a change is logged once, not every interval.
    let mut registered: Option<bool> = None;
    let mut draining = false;
    log::info!("watching {} for {}", cli.engine, heartbeat.key());
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.recv() => break,
            _ = interrupt.recv() => break,
            _ = drain.recv() => {
                log::info!("SIGUSR1: draining, {} leaves the registry", heartbeat.key());
                draining = true;
            }
        }
        let target = HttpPeer::new(cli.engine, false, String::new());
        let health = if draining {
            Err("draining".to_owned())
        } else {
            probe
                .get_from(
                    target,
                    &host,
                    &cli.health_path,
                    interval,
                    interval * 2,
                    64 * 1024,
                )
                .await
                .map(drop)
        };
        let wrote = match &health {
            Ok(()) => heartbeat.beat().await,
            Err(_) => heartbeat.leave().await,
        };
        let now = health.is_ok();
        match (&wrote, registered) {
            (Ok(()), was) if was != Some(now) => {
                match &health {
                    Ok(()) => log::info!("{} is healthy: registered", cli.engine),
                    Err(why) => log::warn!("{} is not healthy ({why}): deregistered", cli.engine),
                }
                registered = Some(now);
            }
            (Ok(()), _) => {}
            (Err(e), _) => {
                log::warn!("registry unreachable, trying again next interval: {e}");
                // Said again once it answers.
                registered = None;
            }
        }
    }
    heartbeat.leave().await?;
    log::info!("stopped: {} left the registry", heartbeat.key());
    Ok(())
}
