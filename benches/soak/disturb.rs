//! The disturbances, carried out and recorded: engines killed and restarted, the peers file
//! rewritten, prefixlb upgraded in place.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::common::sample;
use crate::engines::Engines;
use crate::lb::Lb;
use crate::sampler::admin_peers;

#[derive(Debug, Clone, Serialize)]
pub struct Kill {
    pub engine: String,
    pub at_s: f64,
    /// When it listened again.
    pub back_s: Option<f64>,
    /// Requests it was running just before (its `vllm:num_requests_running`).
    pub running_before: Option<f64>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PeersChange {
    pub at_s: f64,
    pub what: String,
    /// How long until `/admin/peers` listed the new set; `None`: not within 10 s.
    pub applied_ms: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Upgrade {
    pub at_s: f64,
    pub generation: usize,
    /// How long until the new process said it had the sockets.
    pub took_over_ms: Option<u64>,
    pub error: Option<String>,
}

#[derive(Debug, Default, Clone, Serialize)]
pub struct Timeline {
    pub kills: Vec<Kill>,
    pub peers: Vec<PeersChange>,
    pub upgrades: Vec<Upgrade>,
}

/// What carries the disturbances out.
pub struct Disturber {
    pub engines: Engines,
    pub engines_up: Arc<AtomicUsize>,
    pub lb: Arc<Mutex<Lb>>,
    pub admin: SocketAddr,
    /// Each engine's weight in the peers file; 0: left out of it.
    pub weights: Vec<u32>,
    pub epoch: Instant,
    pub restart_after: Duration,
    pub timeline: Timeline,
    kills: usize,
    changes: usize,
    http: reqwest::Client,
}

impl Disturber {
    pub fn new(
        engines: Engines,
        lb: Arc<Mutex<Lb>>,
        admin: SocketAddr,
        epoch: Instant,
        restart_after: Duration,
    ) -> Self {
        let n = engines.addrs.len();
        Self {
            engines_up: Arc::new(AtomicUsize::new(engines.up())),
            engines,
            lb,
            admin,
            weights: vec![1; n],
            epoch,
            restart_after,
            timeline: Timeline::default(),
            kills: 0,
            changes: 0,
            http: reqwest::Client::new(),
        }
    }

    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    /// The peers file's entries for the current weights.
    pub fn listed(&self) -> Vec<(String, u32)> {
        self.weights
            .iter()
            .enumerate()
            .filter(|(_, w)| **w > 0)
            .map(|(i, w)| (self.engines.name(i), *w))
            .collect()
    }

    /// Kills the next engine the peers file lists (one left out carries nothing to cut), and
    /// restarts it on its port once `restart_after` has passed.
    pub async fn kill(&mut self) {
        let n = self.weights.len();
        let i = (0..n)
            .map(|k| (self.kills + k) % n)
            .find(|i| self.weights[*i] > 0)
            .unwrap_or(self.kills % n);
        self.kills = i + 1;
        let running_before = self
            .http
            .get(format!("http://{}/metrics", self.engines.addrs[i]))
            .timeout(Duration::from_secs(1))
            .send()
            .await
            .ok();
        let running_before = match running_before {
            Some(r) => r
                .text()
                .await
                .ok()
                .map(|m| sample(&m, "vllm:num_requests_running")),
            None => None,
        };
        let at_s = self.now();
        self.engines.kill(i);
        self.engines_up.store(self.engines.up(), Ordering::SeqCst);
        println!(
            "{at_s:>7.1}s kill engine {} ({running_before:?} running)",
            self.engines.name(i)
        );
        tokio::time::sleep(self.restart_after).await;
        let restarted = self.engines.restart(i).await;
        self.engines_up.store(self.engines.up(), Ordering::SeqCst);
        let back_s = self.now();
        println!(
            "{back_s:>7.1}s engine {} back: {restarted:?}",
            self.engines.name(i)
        );
        self.timeline.kills.push(Kill {
            engine: self.engines.name(i),
            at_s,
            back_s: restarted.is_ok().then_some(back_s),
            running_before,
            error: restarted.err(),
        });
    }

    /// The next change of the cycle: an engine left out of the file, then listed again; then
    /// another's weight raised, then set back.
    pub async fn change_peers(&mut self) {
        let n = self.weights.len();
        let round = self.changes / 4;
        let (out, heavy) = ((round * 2 + 1) % n, (round * 2 + 2) % n);
        let what = match self.changes % 4 {
            0 => {
                self.weights[out] = 0;
                format!("{} left out", self.engines.name(out))
            }
            1 => {
                self.weights[out] = 1;
                format!("{} listed again", self.engines.name(out))
            }
            2 => {
                self.weights[heavy] = 3;
                format!("{} weight 3", self.engines.name(heavy))
            }
            _ => {
                self.weights[heavy] = 1;
                format!("{} weight 1", self.engines.name(heavy))
            }
        };
        self.changes += 1;
        let at_s = self.now();
        let written = self.lb.lock().unwrap().write_peers(&self.listed());
        let applied_ms = match written {
            Ok(()) => self.applied().await,
            Err(e) => {
                println!("peers file not written: {e}");
                None
            }
        };
        println!("{at_s:>7.1}s peers file: {what} (applied after {applied_ms:?} ms)");
        self.timeline.peers.push(PeersChange {
            at_s,
            what,
            applied_ms,
        });
    }

    /// How long until prefixlb lists the peers the file holds, in milliseconds.
    async fn applied(&self) -> Option<u64> {
        let mut want: Vec<(String, u64)> = self
            .listed()
            .into_iter()
            .map(|(a, w)| (a, u64::from(w)))
            .collect();
        want.sort();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Some(listing) = admin_peers(&self.http, self.admin).await {
                let mut have: Vec<(String, u64)> = listing["peers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|p| {
                        Some((p["address"].as_str()?.to_owned(), p["weight"].as_u64()?))
                    })
                    .collect();
                have.sort();
                if have == want {
                    return Some(start.elapsed().as_millis() as u64);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// A binary upgrade, waited for until the new process has the sockets.
    pub async fn upgrade(&mut self) {
        let at_s = self.now();
        let started = self.lb.lock().unwrap().begin_upgrade();
        let generation = self.lb.lock().unwrap().newest().index;
        let mut record = Upgrade {
            at_s,
            generation,
            took_over_ms: None,
            error: started.err(),
        };
        let start = Instant::now();
        while record.error.is_none() && record.took_over_ms.is_none() {
            match self.lb.lock().unwrap().took_over() {
                Ok(true) => record.took_over_ms = Some(start.elapsed().as_millis() as u64),
                Ok(false) if start.elapsed() > Duration::from_secs(15) => {
                    record.error = Some("no `Bootstrap done` after 15 s".into())
                }
                Ok(false) => {}
                Err(e) => record.error = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "{at_s:>7.1}s upgrade to gen {generation}: {}",
            record
                .error
                .clone()
                .unwrap_or_else(|| format!("took over in {} ms", record.took_over_ms.unwrap_or(0)))
        );
        self.timeline.upgrades.push(record);
    }
}
