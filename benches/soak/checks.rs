//! The checks beside the trends: connections, slots, lost requests, the disturbances.

use crate::disturb::Timeline;
use crate::end::End;
use crate::report::GenInfo;
use crate::verdict::{Check, Classified};

/// Connections the idle process may keep: a health check and a metrics scrape per engine,
/// and the bench's own admin reads.
fn idle_connections(engines: usize) -> usize {
    2 * engines + 4
}

pub fn connections(end: &End, engines: usize) -> Check {
    let c = &end.idle_connections;
    let most = idle_connections(engines);
    Check {
        name: "connections closed when idle",
        pass: c.clients == 0 && c.close_wait == 0 && c.upstream + c.admin + c.other <= most,
        detail: format!(
            "established once idle: {} from clients, {} to engines, {} admin, {} other (at most {most} besides clients); {} in CLOSE_WAIT",
            c.clients, c.upstream, c.admin, c.other, c.close_wait
        ),
    }
}

/// Whether any request was lost: failed otherwise than at an engine kill.
pub fn lost(failures: &[Classified], timeline: &Timeline) -> Check {
    let cut = failures.iter().filter(|c| c.cut_by_kill.is_some()).count();
    let mid_stream = failures
        .iter()
        .filter(|c| c.cut_by_kill.is_some() && c.failure.cause.mid_stream())
        .count();
    let lost = failures.len() - cut;
    Check {
        name: "no lost request",
        pass: lost == 0,
        detail: format!(
            "{lost} lost; {cut} failed at {} engine kills: {mid_stream} streams cut mid-way, {} refused before a response head",
            timeline.kills.len(),
            cut - mid_stream
        ),
    }
}

pub fn in_flight(end: &End) -> Check {
    let held: Vec<String> = end
        .peers_in_flight
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(p, n)| format!("{p}: {n}"))
        .collect();
    let running: Vec<String> = end
        .engines_running
        .iter()
        .map(|(e, n)| format!("{e}: {}", n.map_or("?".into(), |n| format!("{n:.0}"))))
        .collect();
    Check {
        name: "nothing in flight at the end",
        pass: end.idle(),
        detail: format!(
            "after {:.1} s of drain: admin in_flight {:?}, waiting {:?}, peers holding [{}], metrics {:?}; engines running [{}]",
            end.drained_after_s,
            end.in_flight,
            end.waiting,
            held.join(", "),
            end.metrics_in_flight,
            running.join(", ")
        ),
    }
}

pub fn disturbances(timeline: &Timeline, generations: &[GenInfo], end: &End) -> Check {
    let failed: Vec<String> = timeline
        .upgrades
        .iter()
        .filter_map(|u| {
            u.error
                .as_ref()
                .map(|e| format!("gen {}: {e}", u.generation))
        })
        .collect();
    let lingered: Vec<String> = generations
        .iter()
        .filter_map(|g| {
            let quit = g.quit_s?;
            Some(match &g.exit {
                Some(e) => format!(
                    "gen {} left {:.1} s after its SIGQUIT ({})",
                    g.index,
                    e.at_s - quit,
                    e.status
                ),
                None => format!("gen {} still running", g.index),
            })
        })
        .collect();
    let unclean = generations
        .iter()
        .filter(|g| g.quit_s.is_some() && !g.exit.as_ref().is_some_and(|e| e.clean))
        .count();
    let newest_exit = generations.last().and_then(|g| g.exit.as_ref());
    let restarts_failed = timeline.kills.iter().filter(|k| k.error.is_some()).count();
    let unapplied = timeline
        .peers
        .iter()
        .filter(|p| p.applied_ms.is_none())
        .count();
    Check {
        name: "upgrades, restarts, peers file",
        pass: failed.is_empty()
            && unclean == 0
            && end.old_alive.is_empty()
            && restarts_failed == 0
            && unapplied == 0
            && newest_exit.is_none()
            && !timeline.upgrades.is_empty(),
        detail: format!(
            "{} upgrades, {} failed{}; {}; newest process {}; {} of {} engine restarts failed; {} of {} peers-file changes not listed by prefixlb within 10 s",
            timeline.upgrades.len(),
            failed.len(),
            if failed.is_empty() {
                String::new()
            } else {
                format!(" ({})", failed.join("; "))
            },
            if lingered.is_empty() {
                "no old process".into()
            } else {
                lingered.join(", ")
            },
            newest_exit.map_or("running".into(), |e| format!("exited ({})", e.status)),
            restarts_failed,
            timeline.kills.len(),
            unapplied,
            timeline.peers.len()
        ),
    }
}
