//! How long the soak runs, how often each disturbance comes, and the disturbances laid out in
//! time. The nominal figures are those of the 30-minute run; a shorter run shrinks every
//! interval in proportion, so that it still holds each kind of disturbance.

use std::time::Duration;

/// The run's length when `SOAK_MINUTES` is not set.
const DEFAULT_MINUTES: f64 = 30.0;

#[derive(Debug, Clone)]
pub struct Plan {
    pub total: Duration,
    pub kill_every: Duration,
    /// How long a killed engine stays down.
    pub restart_after: Duration,
    pub rewrite_every: Duration,
    pub upgrade_every: Duration,
    pub sample_every: Duration,
    /// Skipped at the start of each prefixlb process before its memory and descriptors are
    /// judged: a fresh process grows its pools and prefix record first.
    pub warm_up: Duration,
    /// Longest wait, once the clients stopped, for every slot to be released and every old
    /// process to leave.
    pub drain: Duration,
    /// Closest two disturbances may come, so that each one's effects are told apart.
    pub gap: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// SIGKILL to the next listed engine, restarted on its port `restart_after` later.
    Kill,
    /// The next change in the peers file's cycle.
    Peers,
    /// A new prefixlb process started with `-u`, SIGQUIT to the old one.
    Upgrade,
}

impl Plan {
    pub fn from_env() -> Result<Self, String> {
        let minutes = match std::env::var("SOAK_MINUTES") {
            Ok(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|m| *m >= 1.0)
                .ok_or_else(|| format!("SOAK_MINUTES={v}: a number of minutes, at least 1"))?,
            Err(_) => DEFAULT_MINUTES,
        };
        Ok(Self::for_minutes(minutes))
    }

    pub fn for_minutes(minutes: f64) -> Self {
        // Longer runs keep the nominal pace: more disturbances, not rarer ones.
        let scale = (minutes / DEFAULT_MINUTES).min(1.0);
        let scaled = |secs: f64| Duration::from_secs_f64(secs * scale);
        let kill_every = scaled(240.0);
        let restart_after = Duration::from_secs(5).min(kill_every / 4);
        Self {
            total: Duration::from_secs_f64(minutes * 60.0),
            kill_every,
            restart_after,
            rewrite_every: scaled(180.0),
            upgrade_every: scaled(600.0),
            sample_every: scaled(10.0).clamp(Duration::from_secs(2), Duration::from_secs(10)),
            warm_up: scaled(180.0),
            drain: Duration::from_secs(30),
            gap: (restart_after + Duration::from_secs(3)).max(scaled(15.0)),
        }
    }

    /// Every disturbance and when it comes, from the start of the load. Each kind keeps its
    /// own period, offset so that the kinds interleave; one that would come within `gap` of
    /// the one before is moved later, and none comes so late that its effects would run past
    /// the end of the load.
    pub fn schedule(&self) -> Vec<(Duration, Event)> {
        let mut nominal = Vec::new();
        let mut add = |every: Duration, offset: f64, event: Event| {
            let mut k = 0.0;
            loop {
                let at = every.mul_f64(k + offset);
                if at >= self.total {
                    break;
                }
                nominal.push((at, event));
                k += 1.0;
            }
        };
        add(self.kill_every, 0.5, Event::Kill);
        add(self.rewrite_every, 0.5, Event::Peers);
        add(self.upgrade_every, 1.0, Event::Upgrade);
        nominal.sort_by_key(|(at, _)| *at);
        let last = self
            .total
            .saturating_sub(self.restart_after + self.gap + Duration::from_secs(5));
        let mut placed: Vec<(Duration, Event)> = Vec::new();
        for (at, event) in nominal {
            let at = placed
                .last()
                .map_or(at, |(prev, _)| at.max(*prev + self.gap));
            if at <= last {
                placed.push((at, event));
            }
        }
        placed
    }
}
