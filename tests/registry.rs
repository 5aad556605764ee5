//! The heartbeat registry against a real `redis-server` (started here on a free port): peers
//! that register, change and leave, a Redis restart under load, and `prefixlb-agent` beside an
//! engine.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

const PREFIX: &str = "prefixlb:peers:";

/// A `redis-server` of the test's own, without persistence: a restart forgets every key.
struct Redis {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Redis {
    /// On a free port. A parallel test may bind that port between its lookup and the server's
    /// start; the server then exits, and it starts again on another.
    async fn start() -> Redis {
        for _ in 0..4 {
            if let Some(redis) = Redis::try_start_on(free_port()).await {
                return redis;
            }
        }
        panic!("redis-server did not start on any of four free ports");
    }

    /// On `port`, as a restart must be to keep its address.
    async fn start_on(port: u16) -> Redis {
        Redis::try_start_on(port)
            .await
            .unwrap_or_else(|| panic!("redis-server did not start on {port}"))
    }

    /// The server once it answers PING: something else listening on the port would not.
    async fn try_start_on(port: u16) -> Option<Redis> {
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server (the Debian package redis-server; .ci/run installs it)");
        let mut redis = Redis {
            child,
            port,
            _dir: dir,
        };
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20) {
            if redis.child.try_wait().unwrap().is_some() {
                return None;
            }
            if redis.answers_ping().await {
                return Some(redis);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    async fn answers_ping(&self) -> bool {
        let ping = async {
            let client = redis::Client::open(self.url())?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("PING").query_async::<String>(&mut conn).await
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(1), ping).await,
            Ok(Ok(pong)) if pong == "PONG"
        )
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn register(
    conn: &mut redis::aio::MultiplexedConnection,
    up: &Upstream,
    value: &str,
    ttl_ms: u64,
) -> redis::RedisResult<()> {
    redis::cmd("SET")
        .arg(format!("{PREFIX}{}", up.addr))
        .arg(value)
        .arg("PX")
        .arg(ttl_ms)
        .query_async(conn)
        .await
}

fn registry_config(redis: &Redis, allow_empty: bool) -> TestConfig {
    TestConfig::new()
        .redis(&redis.url(), 200)
        .allow_empty(allow_empty)
        .no_health_check()
}

/// Waits (at most `limit`) until the proxy's peers, address to weight, are `want`.
async fn wait_peers(proxy: &Proxy, want: &[(&Upstream, u64)], limit: Duration) {
    let mut want: Vec<(String, u64)> = want.iter().map(|(u, w)| (u.addr_str(), *w)).collect();
    want.sort();
    let start = Instant::now();
    loop {
        let mut have = members(proxy.peers().await);
        have.sort();
        if have == want {
            return;
        }
        assert!(
            start.elapsed() < limit,
            "peers {have:?}, not {want:?}, after {limit:?}: {}",
            proxy.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn peers_register_change_and_leave_by_heartbeat() {
    let redis = Redis::start().await;
    let (a, b) = (start_upstream("a").await, start_upstream("b").await);
    let mut conn = redis.connection().await;
    register(&mut conn, &a, r#"{"weight": 1}"#, 60_000)
        .await
        .unwrap();
    register(
        &mut conn,
        &b,
        r#"{"weight": 2, "max_in_flight": 8}"#,
        60_000,
    )
    .await
    .unwrap();
    let proxy = start_proxy(&registry_config(&redis, true)).await;
    wait_peers(&proxy, &[(&a, 1), (&b, 2)], Duration::from_secs(2)).await;
    let answer = client()
        .post(proxy.url("/v1/chat/completions"))
        .body(chat("s", "q", 1, false))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);

    register(&mut conn, &b, r#"{"weight": 3}"#, 60_000)
        .await
        .unwrap();
    // a's agent stops refreshing it: its key expires in 1 s, and the peer leaves with it.
    redis::cmd("PEXPIRE")
        .arg(format!("{PREFIX}{}", a.addr))
        .arg(1000)
        .query_async::<()>(&mut conn)
        .await
        .unwrap();
    wait_peers(&proxy, &[(&b, 3)], Duration::from_secs(3)).await;
    redis::cmd("DEL")
        .arg(format!("{PREFIX}{}", b.addr))
        .query_async::<()>(&mut conn)
        .await
        .unwrap();
    wait_peers(&proxy, &[], Duration::from_secs(2)).await;
    // A bad entry is skipped, not the registry: not an address, not UTF-8 in its name or value.
    let b_key = format!("{PREFIX}{}", b.addr).into_bytes();
    for (key, value) in [
        (
            format!("{PREFIX}not-an-address").into_bytes(),
            b"{}".to_vec(),
        ),
        ([PREFIX.as_bytes(), b"\xff\xfe:1"].concat(), b"{}".to_vec()),
        (b_key, b"{\"weight\": \"\xff\"}".to_vec()),
    ] {
        redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query_async::<()>(&mut conn)
            .await
            .unwrap();
    }
    register(&mut conn, &a, "{}", 60_000).await.unwrap();
    wait_peers(&proxy, &[(&a, 1)], Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_under_load_fails_no_request() {
    let mut redis = Redis::start().await;
    let (a, b) = (start_upstream("a").await, start_upstream("b").await);
    let port = redis.port;
    let url = redis.url();
    // a's agent: a heartbeat every 200 ms that rides out Redis being away.
    let heartbeat = {
        let (url, addr) = (url.clone(), a.addr);
        tokio::spawn(async move {
            loop {
                if let Ok(client) = redis::Client::open(url.as_str()) {
                    if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                        let _ = redis::cmd("SET")
                            .arg(format!("{PREFIX}{addr}"))
                            .arg("{}")
                            .arg("PX")
                            .arg(2000)
                            .query_async::<()>(&mut conn)
                            .await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let proxy = Arc::new(start_proxy(&registry_config(&redis, false)).await);
    wait_peers(&proxy, &[(&a, 1)], Duration::from_secs(2)).await;
    // The connection of the first read, made before serving, is not used after it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(registry_failures(&proxy).await, 0, "{}", proxy.log());

    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let deadline = Instant::now() + Duration::from_secs(3);
    let load: Vec<_> = (0..4)
        .map(|_| {
            let (proxy, sent, failed) =
                (Arc::clone(&proxy), Arc::clone(&sent), Arc::clone(&failed));
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let ok = client()
                        .post(proxy.url("/v1/chat/completions"))
                        .body(chat("s", "q", 1, false))
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200);
                    sent.fetch_add(1, Ordering::SeqCst);
                    if !ok {
                        failed.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let failures_before = registry_failures(&proxy).await;
    let log_before = proxy.log().len();
    redis.kill();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let redis = Redis::start_on(port).await;
    for l in load {
        l.await.unwrap();
    }
    assert!(sent.load(Ordering::SeqCst) > 50, "too little load to tell");
    assert_eq!(failed.load(Ordering::SeqCst), 0);
    assert!(
        registry_failures(&proxy).await > failures_before,
        "Redis was never seen away"
    );
    assert!(proxy.log()[log_before..].contains("keeping the current ones"));

    // Back: it follows the registry again.
    let mut conn = redis.connection().await;
    register(&mut conn, &b, "{}", 60_000).await.unwrap();
    wait_peers(&proxy, &[(&a, 1), (&b, 1)], Duration::from_secs(3)).await;
    heartbeat.abort();
}

async fn registry_failures(proxy: &Proxy) -> u64 {
    proxy
        .metrics()
        .await
        .lines()
        .find_map(|l| l.strip_prefix("prefixlb_registry_failures_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn agent(redis: &Redis, engine: &Upstream) -> Child {
    Command::new(env!("CARGO_BIN_EXE_prefixlb-agent"))
        .args(["--redis", &redis.url(), "--engine", &engine.addr_str()])
        .args(["--weight", "2", "--interval-ms", "200", "--ttl-ms", "1000"])
        .args(["--models", "m,sql-lora"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

async fn key_of(conn: &mut redis::aio::MultiplexedConnection, up: &Upstream) -> Option<String> {
    redis::cmd("GET")
        .arg(format!("{PREFIX}{}", up.addr))
        .query_async(conn)
        .await
        .unwrap()
}

async fn wait_key(
    conn: &mut redis::aio::MultiplexedConnection,
    up: &Upstream,
    present: bool,
    limit: Duration,
) -> Option<String> {
    let start = Instant::now();
    loop {
        let value = key_of(conn, up).await;
        if value.is_some() == present {
            return value;
        }
        assert!(start.elapsed() < limit, "key present: {}", !present);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_agent_keeps_a_healthy_engine_registered_and_removes_it_when_it_fails_or_stops() {
    let redis = Redis::start().await;
    let engine = start_upstream("a").await;
    let mut conn = redis.connection().await;
    let mut agent = agent(&redis, &engine);
    let value = wait_key(&mut conn, &engine, true, Duration::from_secs(3)).await;
    let entry: serde_json::Value = serde_json::from_str(&value.unwrap()).unwrap();
    assert_eq!(entry["weight"], 2);
    assert_eq!(entry["models"], serde_json::json!(["m", "sql-lora"]));
    let proxy = start_proxy(&registry_config(&redis, true)).await;
    wait_peers(&proxy, &[(&engine, 2)], Duration::from_secs(2)).await;

    engine.healthy.store(false, Ordering::SeqCst);
    let failed = Instant::now();
    wait_key(&mut conn, &engine, false, Duration::from_secs(2)).await;
    wait_peers(&proxy, &[], Duration::from_secs(2)).await;
    assert!(failed.elapsed() < Duration::from_secs(2));

    engine.healthy.store(true, Ordering::SeqCst);
    wait_key(&mut conn, &engine, true, Duration::from_secs(2)).await;
    wait_peers(&proxy, &[(&engine, 2)], Duration::from_secs(2)).await;

    send_signal(agent.id(), "TERM");
    exits(&mut agent, Duration::from_secs(3)).await;
    // Deleted on the way out, not left to expire.
    assert_eq!(key_of(&mut conn, &engine).await, None);
    wait_peers(&proxy, &[], Duration::from_secs(2)).await;
}

/// Figures prefixlb would skip the node for, or that would stop the agent's loop, are refused
/// at the command line, before anything is registered.
#[test]
fn the_agent_refuses_figures_prefixlb_would_not_take() {
    for bad in [
        ["--weight", "0"],
        ["--weight", "101"],
        ["--max-in-flight", "0"],
        ["--interval-ms", "0"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_prefixlb-agent"))
            .args(["--redis", "redis://127.0.0.1:1", "--engine", "127.0.0.1:1"])
            .args(bad)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {said}");
        assert!(
            said.contains(bad[0]) && !said.contains("panicked"),
            "{said}"
        );
    }
}
