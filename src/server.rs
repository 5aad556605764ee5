//! The server: Pingora's, with the routing proxy, the control plane and the admin API, as the
//! `prefixlb` binary (and the demo) run it from a command line.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use pingora::listeners::{L4BufferSettings, ListenerConfig};
use pingora::server::configuration::{Opt, ServerConf};
use pingora::server::{RunArgs, Server};
use pingora::services::background::background_service;
use pingora::services::listening::Service;

use crate::admin::Admin;
use crate::control::discovery::source::{AtStart, PeerSource};
use crate::control::engine::EngineFeedback;
use crate::control::models::ModelLists;
use crate::control::progress::ProgressWatch;
use crate::control::replicas::keys::KeyFile;
use crate::control::replicas::ReplicaExchange;
use crate::control::watch::{CertFiles, FileWatch, KeysFile, SettledFile, Watched};
use crate::control::ControlPlane;
use crate::lifecycle::{self, Activity, Signals};
use crate::proxy::shared_load::{Publisher, SharedLoad};
use crate::proxy::PrefixLb;
use crate::router::Router;
use crate::tenants::{ClientAuth, Tenants};
use crate::tls::CertStore;
use crate::traces::{Exporter, Traces};

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
fn initial_peers(source: &mut dyn PeerSource) -> Result<Vec<crate::routing::PeerSpec>, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let loaded = runtime.block_on(source.peers(true));
    loaded
        .map(Option::unwrap_or_default)
        .map_err(|e| format!("{}: {e}", source.label()))
}

/// Runs prefixlb on the command line `args` (its first item being the program's name); returns
/// only when it could not start.
pub fn main_from<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    lifecycle::ignore_until_running();
    let mut cli = Cli::parse_from(args);
    // A daemon runs from /: reloads must find the files the command line and the
    // configuration meant, taken from here (this first call pins the directory for every
    // later one). Not resolved through symlinks, which a ConfigMap's update repoints.
    cli.lb_conf = crate::config::paths::absolute(&cli.lb_conf);
    let Err(e) = run(cli);
    eprintln!("prefixlb: {e}");
    ExitCode::FAILURE
}

/// Serves until the process is told to stop; returns only what kept it from starting.
fn run(cli: Cli) -> Result<std::convert::Infallible, String> {
    let activity = Arc::new(Activity::default());
    let lb_conf = cli.lb_conf.clone();
    let in_file = |e: &dyn std::fmt::Display| format!("{}: {e}", lb_conf.display());
    let (settings, renamed) = crate::config::load(&lb_conf).map_err(|e| in_file(&e))?;
    for r in renamed {
        log::warn!("{}: {r}", lb_conf.display());
    }
    let pingora_file = cli.server.conf.clone();
    if let Some(conf) = &pingora_file {
        ServerConf::load_from_yaml(conf).map_err(|e| format!("{conf}: {e}"))?;
    }
    let router = Arc::new(Router::new(settings.router.clone(), &settings.peers));
    let mut source =
        crate::control::discovery::build(&settings.discovery, &lb_conf).map_err(|e| in_file(&e))?;
    // Peers from a peers file or DNS are there before the first request, not at the control
    // plane's first tick: after an upgrade, the new process serves at once.
    let at_start = source.at_start();
    if at_start != AtStart::Loaded {
        let initial = initial_peers(source.as_mut());
        // Connections made on that runtime die with it.
        source.disconnect();
        match initial {
            Ok(specs) => {
                router.set_peers(specs);
            }
            // A name service or registry that is down now may be back in a moment; `-t` still
            // says it is not reachable.
            Err(e) if at_start == AtStart::Tried && !cli.server.test => {
                log::warn!(
                    "no peers from {} yet, starting without: {e}",
                    source.label()
                );
            }
            Err(e) => return Err(e),
        }
    }
    // Keys and certificates are read before serving, so that a bad one stops the start.
    let mut watching = Watching::load(&settings)?;
    if cli.server.test {
        println!("prefixlb: {} is valid", lb_conf.display());
        std::process::exit(0);
    }
    let successor = cli.server.upgrade;
    let mut server = Server::new(Some(cli.server)).map_err(|e| e.to_string())?;
    if let Some(conf) = Arc::get_mut(&mut server.configuration) {
        pingora_defaults(pingora_file.as_deref(), conf);
    }
    let upgrade_sock = PathBuf::from(&server.configuration.upgrade_sock);
    let shared = Arc::new(SharedLoad::new(
        Arc::clone(&router),
        &upgrade_sock,
        successor,
    ));
    // The sockets of an upgrade are taken by a service, after daemonizing: `-u -d` returns at
    // once and leaves the daemon waiting for them, so the old process can be told to hand them
    // over next (the unit's order). Taken before `run`, they would block the launcher until the
    // old process, not yet told, sent them.
    let bootstrap = server.bootstrap_as_a_service();
    // Once the sockets are here: a successor that published before, and found itself alone in
    // the file for a second because the old process was told late, would leave sharing for good.
    server
        .add_service(background_service(
            "shared in-flight counts",
            Publisher(Arc::clone(&shared)),
        ))
        .add_dependency(&bootstrap);

    let mut lb = PrefixLb::new(
        Arc::clone(&router),
        settings.proxy.clone(),
        Arc::clone(&activity),
        Arc::clone(&shared),
    );
    let mut watched: Vec<Box<dyn Watched>> = Vec::new();
    if let Some(auth) = &watching.keys {
        lb = lb.with_auth(ClientAuth {
            tenants: Arc::clone(&auth.tenants),
            forward_key: settings.auth.as_ref().is_some_and(|a| a.forward_key),
        });
    }
    let tenants = watching.keys.as_ref().map(|k| Arc::clone(&k.tenants));
    if let Some(traces) = settings.tracing.clone().map(Traces::new) {
        lb = lb.with_traces(Arc::clone(&traces));
        server.add_service(background_service("traces", Exporter(traces)));
    }
    let mut proxy = crate::proxy::service::proxy_service(
        &server.configuration,
        lb,
        Arc::clone(&activity),
        settings.h2c,
        settings.proxy.client_header_timeout,
    );
    for listener in &settings.listen {
        let addr = listener.addr.to_string();
        // Pingora reads a request's head and body into buffers of its own, and rustls into its
        // record buffer: a read buffer in front of them (64 KiB by default) only copies, and
        // keeps pages of every open connection (`cargo bench --bench memory`).
        let config =
            ListenerConfig::tcp(addr.as_str()).l4_buffer(L4BufferSettings::default().read(0));
        match (&listener.tls, watching.certs.remove(&listener.addr)) {
            (Some(files), Some(cert)) => {
                let tls = cert
                    .store
                    .listener_settings(files)
                    .map_err(|e| e.to_string())?;
                proxy.add_listener(config.tls(tls));
                watched.push(Box::new(cert));
            }
            (None, _) => proxy.add_listener(config),
            (Some(_), None) => {
                return Err(format!("listener {addr}: its certificate was not read"))
            }
        }
    }
    if let Some(keys) = watching.keys {
        watched.push(Box::new(keys));
    }
    let replica_keys = watching.replica_keys.as_ref().map(KeyFile::keys);
    if let Some(file) = watching.replica_keys {
        watched.push(Box::new(file));
    }
    server.add_service(proxy).add_dependency(&bootstrap);
    if !watched.is_empty() {
        server.add_service(background_service("watched files", FileWatch::new(watched)));
    }
    crate::metrics::register(Arc::clone(&router), tenants).map_err(|e| format!("metrics: {e}"))?;
    let control = ControlPlane::new(
        Arc::clone(&router),
        source,
        settings.allow_empty_peers,
        settings.health_check.as_ref(),
        &settings.proxy.upstream.tls,
    )
    .map_err(|e| format!("health check setup: {e}"))?;
    server.add_service(background_service("control plane", control));
    let wedge_after = settings.proxy.upstream.wedge_after;
    if !wedge_after.is_zero() {
        server.add_service(background_service(
            "engine progress",
            ProgressWatch::new(Arc::clone(&router), wedge_after),
        ));
    }
    if let Some(engine) = &settings.engine_metrics {
        server.add_service(background_service(
            "engine metrics",
            EngineFeedback::new(
                Arc::clone(&router),
                engine.clone(),
                settings.proxy.upstream.tls.clone(),
            ),
        ));
    }
    if let Some(replicas) = &settings.replicas {
        server.add_service(background_service(
            "replicas",
            ReplicaExchange::new(Arc::clone(&router), replicas.clone(), replica_keys),
        ));
    }
    if let Some(discovery) = &settings.model_discovery {
        server.add_service(background_service(
            "model lists",
            ModelLists::new(
                Arc::clone(&router),
                discovery.clone(),
                settings.proxy.upstream.tls.clone(),
            ),
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
    crate::access_log::drain(std::time::Duration::from_secs(1));
    crate::traces::drain(std::time::Duration::from_secs(2));
    std::process::exit(0)
}

/// The keys and certificates as read at start, with the files they are kept in step with.
struct Watching {
    keys: Option<KeysFile>,
    certs: std::collections::HashMap<std::net::SocketAddr, CertFiles>,
    replica_keys: Option<KeyFile>,
}

impl Watching {
    fn load(settings: &crate::settings::Settings) -> Result<Self, String> {
        let read = |path: &std::path::Path| {
            std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
        };
        let settled = |path: &std::path::Path, text: String| {
            let mut file = SettledFile::new(path.to_owned());
            file.mark_read(text);
            file
        };
        let keys = match &settings.auth {
            Some(auth) => {
                let text = read(&auth.keys_file)?;
                let tenants = Tenants::parse(&text)
                    .map_err(|e| format!("{}: {e}", auth.keys_file.display()))?;
                Some(KeysFile {
                    file: settled(&auth.keys_file, text),
                    tenants: Arc::new(tenants),
                })
            }
            None => None,
        };
        let mut certs = std::collections::HashMap::new();
        for listener in &settings.listen {
            let Some(files) = &listener.tls else {
                continue;
            };
            let (cert, key) = (read(&files.cert)?, read(&files.key)?);
            let store = CertStore::new(cert.as_bytes(), key.as_bytes())
                .map_err(|e| format!("listener {}: {e}", listener.addr))?;
            certs.insert(
                listener.addr,
                CertFiles {
                    cert: settled(&files.cert, cert),
                    key: settled(&files.key, key),
                    store: Arc::new(store),
                    refused: false,
                },
            );
        }
        let replica_keys = match settings.replicas.as_ref().and_then(|r| r.key_file.as_ref()) {
            Some(path) => Some(KeyFile::load(path)?),
            None => None,
        };
        Ok(Self {
            keys,
            certs,
            replica_keys,
        })
    }
}

/// prefixlb's defaults for what Pingora's file `file` leaves out: a worker thread per CPU
/// (Pingora's own default, 1, does not fit most machines) and the fast-timer limit below.
pub fn pingora_defaults(file: Option<&str>, conf: &mut ServerConf) {
    let given: serde_yaml::Mapping = file
        .and_then(|f| std::fs::read_to_string(f).ok())
        .and_then(|text| serde_yaml::from_str(&text).ok())
        .unwrap_or_default();
    if !given.contains_key("threads") {
        conf.threads = default_threads();
    }
    if !given.contains_key("fast_timeout_to_tokio_threshold_seconds") {
        conf.fast_timeout_to_tokio_threshold_seconds = Some(FAST_TIMER_LIMIT_S);
    }
}

/// Longest timeout, in whole seconds, kept on Pingora's fast timer; longer ones go to Tokio's.
/// A fast timer cannot be cancelled: it stays in its thread's map until its deadline, one entry
/// per 10 ms slot. At Pingora's default (900 s) every request's 10-minute read timeout stayed
/// there, and a process under a steady stream load grew about 1 MiB per 1,000 requests for its
/// first ten minutes (the soak bench's RSS check, heaptrack). At 5 s a worker's map holds at
/// most 500 entries, and the read, idle and keep-alive timeouts are cancelled with the request.
const FAST_TIMER_LIMIT_S: u64 = 5;

/// One worker thread per CPU this process may run on (its affinity mask, a cgroup's quota).
fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn listing(listeners: &[crate::settings::Listener]) -> String {
    listeners
        .iter()
        .map(|l| match l.tls {
            Some(_) => format!("{} (TLS)", l.addr),
            None => l.addr.to_string(),
        })
        .collect::<Vec<_>>()
        .join(", ")
}
