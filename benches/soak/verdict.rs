//! What the run comes to: the trend of memory and descriptors in each prefixlb process once
//! warm, which failed requests an engine kill explains and which are lost, and the checks.

use serde::Serialize;

use crate::disturb::Timeline;
use crate::load::Failure;
use crate::sampler::Sample;

/// How far memory or descriptors may move after warm-up, in percent of their mean.
pub const FLAT_PCT: f64 = 5.0;
/// A failure this long after its engine came back is no longer the kill's doing: the client
/// notices a cut within milliseconds.
const AFTER_KILL_S: f64 = 2.0;
/// The fewest samples a trend is fitted on.
const MIN_SAMPLES: usize = 5;

/// A least-squares line through a series.
#[derive(Debug, Clone, Serialize)]
pub struct Fit {
    pub samples: usize,
    pub from_s: f64,
    pub to_s: f64,
    pub mean: f64,
    pub slope_per_hour: f64,
    /// What the slope adds up to over the window, in percent of the mean.
    pub drift_pct: f64,
    /// The farthest sample from the mean, in percent of it.
    pub max_dev_pct: f64,
}

impl Fit {
    pub fn of(points: &[(f64, f64)]) -> Option<Self> {
        if points.len() < MIN_SAMPLES {
            return None;
        }
        let n = points.len() as f64;
        let mean_t = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean = points.iter().map(|p| p.1).sum::<f64>() / n;
        let (mut num, mut den) = (0.0, 0.0);
        for (t, v) in points {
            num += (t - mean_t) * (v - mean);
            den += (t - mean_t) * (t - mean_t);
        }
        let slope = if den > 0.0 { num / den } else { 0.0 };
        let (from_s, to_s) = (points[0].0, points[points.len() - 1].0);
        let pct = |x: f64| if mean > 0.0 { 100.0 * x / mean } else { 0.0 };
        Some(Self {
            samples: points.len(),
            from_s,
            to_s,
            mean,
            slope_per_hour: slope * 3600.0,
            drift_pct: pct(slope * (to_s - from_s)),
            max_dev_pct: points
                .iter()
                .map(|(_, v)| pct((v - mean).abs()))
                .fold(0.0, f64::max),
        })
    }

    pub fn flat(&self) -> bool {
        self.drift_pct.abs() <= FLAT_PCT && self.max_dev_pct <= FLAT_PCT
    }
}

/// The trends of one prefixlb process once warm.
#[derive(Debug, Clone, Serialize)]
pub struct Segment {
    pub generation: usize,
    /// Resident memory in MiB.
    pub rss: Option<Fit>,
    /// Every open descriptor: shown, not judged, as it follows the open connections.
    pub fds: Option<Fit>,
    /// Descriptors other than TCP connections: judged.
    pub fds_held: Option<Fit>,
}

/// Each generation's samples from `warm_up_s` of its life on; prefixlb's state does not pass
/// from one process to the next, so each warms up and is judged on its own.
pub fn segments(samples: &[Sample], warm_up_s: f64) -> Vec<Segment> {
    let last = samples.iter().map(|s| s.generation).max().unwrap_or(0);
    (0..=last)
        .map(|g| {
            let warm: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.generation == g && s.age_s >= warm_up_s && !s.after_load)
                .collect();
            let series = |f: &dyn Fn(&Sample) -> f64| {
                Fit::of(&warm.iter().map(|s| (s.t_s, f(s))).collect::<Vec<_>>())
            };
            Segment {
                generation: g,
                rss: series(&|s| s.rss_newest_kib as f64 / 1024.0),
                fds: series(&|s| s.fds_newest as f64),
                fds_held: series(&|s| s.fds.held() as f64),
            }
        })
        .collect()
}

#[derive(Debug, Clone, Serialize)]
pub struct Classified {
    #[serde(flatten)]
    pub failure: Failure,
    /// The kill that explains it (index into the timeline's kills), if one does.
    pub cut_by_kill: Option<usize>,
    /// How it was tied to that kill: `engine` (it was on the killed engine) or `timing`.
    pub tied_by: Option<&'static str>,
    /// Disturbances in the 5 s before it failed.
    pub near: Vec<String>,
    /// What prefixlb's access log says of it.
    pub logged: Option<String>,
}

/// A failure is cut by a kill when it failed while its engine was down (from the kill to
/// shortly after the restart); with its engine unknown, while any engine was.
pub fn classify(f: Failure, timeline: &Timeline, logged: Option<String>) -> Classified {
    let window = |k: &crate::disturb::Kill| {
        let end = k.back_s.unwrap_or(f64::INFINITY) + AFTER_KILL_S;
        f.failed_s >= k.at_s && f.failed_s <= end
    };
    let (cut_by_kill, tied_by) = match &f.engine {
        Some(e) => (
            timeline
                .kills
                .iter()
                .position(|k| &k.engine == e && window(k)),
            Some("engine"),
        ),
        None => (timeline.kills.iter().position(window), Some("timing")),
    };
    let mut near = Vec::new();
    let recent = |at: f64| at <= f.failed_s && f.failed_s - at <= 5.0;
    for k in timeline.kills.iter().filter(|k| recent(k.at_s)) {
        near.push(format!("kill of {} at {:.1} s", k.engine, k.at_s));
    }
    for p in timeline.peers.iter().filter(|p| recent(p.at_s)) {
        near.push(format!("peers file ({}) at {:.1} s", p.what, p.at_s));
    }
    for u in timeline.upgrades.iter().filter(|u| recent(u.at_s)) {
        near.push(format!(
            "upgrade to gen {} at {:.1} s",
            u.generation, u.at_s
        ));
    }
    Classified {
        failure: f,
        tied_by: cut_by_kill.and(tied_by),
        cut_by_kill,
        near,
        logged,
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub pass: bool,
    pub detail: String,
}

/// The memory or descriptor check over every generation warm long enough to be judged.
pub fn flat_check(
    name: &'static str,
    unit: &str,
    segments: &[Segment],
    pick: fn(&Segment) -> &Option<Fit>,
) -> Check {
    let judged: Vec<(usize, &Fit)> = segments
        .iter()
        .filter_map(|s| pick(s).as_ref().map(|f| (s.generation, f)))
        .collect();
    if judged.is_empty() {
        return Check {
            name,
            pass: false,
            detail: format!("no process ran {MIN_SAMPLES} samples past its warm-up"),
        };
    }
    let detail = judged
        .iter()
        .map(|(g, f)| {
            format!(
                "gen {g}: mean {:.1} {unit}, {:+.2} {unit}/h, drift {:+.1}%, max dev {:.1}%",
                f.mean, f.slope_per_hour, f.drift_pct, f.max_dev_pct
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    Check {
        name,
        pass: judged.iter().all(|(_, f)| f.flat()),
        detail,
    }
}
