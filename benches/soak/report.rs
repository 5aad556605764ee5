//! The results: the time series as CSV, everything as JSON, and the markdown summary.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::disturb::Timeline;
use crate::end::{AccessLogs, End, LogProblem};
use crate::lb::Exit;
use crate::sampler::Sample;
use crate::verdict::{Check, Classified, Segment};

#[derive(Debug, Clone, Serialize)]
pub struct GenInfo {
    pub index: usize,
    pub pid: u32,
    pub started_s: f64,
    pub quit_s: Option<f64>,
    pub exit: Option<Exit>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub minutes: f64,
    pub clients: usize,
    pub engines: usize,
    /// Every interval of the plan, in seconds.
    pub plan: Vec<(&'static str, f64)>,
    pub sent: u64,
    pub ok: u64,
    pub failed: usize,
    pub cut_by_kill: usize,
    pub lost: usize,
    pub load_ended_s: f64,
    pub generations: Vec<GenInfo>,
    pub timeline: Timeline,
    pub segments: Vec<Segment>,
    pub end: End,
    pub checks: Vec<Check>,
    pub pass: bool,
    pub failures: Vec<Classified>,
    pub access_logs: AccessLogs,
    pub log_problems: Vec<LogProblem>,
    /// Where prefixlb's and the engines' own files of this run are.
    pub run_dir: PathBuf,
}

/// Writes `soak.csv`, `soak.json` and `soak.md` into `dir`; returns their paths.
pub fn write(dir: &Path, summary: &Summary, samples: &[Sample]) -> Result<Vec<PathBuf>, String> {
    let csv = dir.join("soak.csv");
    let json = dir.join("soak.json");
    let md = dir.join("soak.md");
    let put = |path: &Path, text: String| {
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
    };
    put(&csv, csv_text(samples))?;
    let all = serde_json::json!({"summary": summary, "samples": samples});
    put(
        &json,
        serde_json::to_string_pretty(&all).map_err(|e| e.to_string())?,
    )?;
    put(&md, markdown(summary, usize::MAX))?;
    Ok(vec![csv, json, md])
}

fn csv_text(samples: &[Sample]) -> String {
    let mut out = String::from(
        "t_s,generation,age_s,live,rss_newest_kib,rss_sum_kib,fds_newest,fds_sum,tcp_established,tcp_close_wait,tcp_other,fds_other,cpu_newest_s,in_flight,waiting,peers_listed,engines_up,sent,ok,failed,ttft_p50_ms,ttft_p99_ms,after_load\n",
    );
    let opt = |v: Option<u64>| v.map_or(String::new(), |v| v.to_string());
    for s in samples {
        let _ = writeln!(
            out,
            "{:.1},{},{:.1},{},{},{},{},{},{},{},{},{},{:.2},{},{},{},{},{},{},{},{:.1},{:.1},{}",
            s.t_s,
            s.generation,
            s.age_s,
            s.live,
            s.rss_newest_kib,
            s.rss_sum_kib,
            s.fds_newest,
            s.fds_sum,
            s.fds.tcp_established,
            s.fds.tcp_close_wait,
            s.fds.tcp_other,
            s.fds.other,
            s.cpu_newest_s,
            opt(s.in_flight),
            opt(s.waiting),
            opt(s.peers_listed.map(|n| n as u64)),
            s.engines_up,
            s.sent,
            s.ok,
            s.failed,
            s.ttft_p50_ms,
            s.ttft_p99_ms,
            s.after_load,
        );
    }
    out
}

/// Markdown table cells hold no pipes or line breaks.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

fn secs(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.1}"))
}

/// The summary, with at most `max_failures` failures listed one by one.
pub fn markdown(s: &Summary, max_failures: usize) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Soak: {} min, {} streaming clients, {} gpu-sim engines, {} prefixlb processes\n",
        s.minutes,
        s.clients,
        s.engines,
        s.generations.len()
    );
    let _ = writeln!(
        md,
        "**Verdict: {}**\n",
        if s.pass { "PASS" } else { "FAIL" }
    );
    md.push_str("| Check | Result | Detail |\n|---|---|---|\n");
    for c in &s.checks {
        let result = if c.pass { "pass" } else { "**FAIL**" };
        let _ = writeln!(md, "| {} | {result} | {} |", c.name, cell(&c.detail));
    }
    let plan: Vec<String> = s
        .plan
        .iter()
        .map(|(k, v)| format!("{k} {v:.0} s"))
        .collect();
    let _ = writeln!(
        md,
        "\nPlan: {}. Memory and descriptors are the newest prefixlb process's, judged per \
         process from the end of its warm-up (each process starts afresh after an upgrade); \
         flat: the least-squares drift over the window and the farthest sample both within \
         5% of the mean. Descriptors are judged without the TCP connections, which follow the \
         load (a kill drops a tenth of them, a peer listed again adds its pool): all of them \
         are shown, and the connections are judged once idle instead.\n",
        plan.join(", ")
    );
    let _ = writeln!(
        md,
        "Requests: {} sent, {} whole, {} failed: {} cut by an engine kill, {} lost. Load \
         stopped at {:.0} s.\n",
        s.sent, s.ok, s.failed, s.cut_by_kill, s.lost, s.load_ended_s
    );

    md.push_str("## Memory and descriptors after warm-up\n\n");
    md.push_str("| Process | From-to (s) | Samples | RSS mean (MiB) | RSS slope (MiB/h) | RSS drift | RSS max dev | fds mean | fds slope (/h) | fds drift | fds max dev | non-TCP fds mean | drift | max dev |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for seg in &s.segments {
        match (&seg.rss, &seg.fds, &seg.fds_held) {
            (Some(r), Some(f), Some(h)) => {
                let _ = writeln!(
                    md,
                    "| gen {} | {:.0}-{:.0} | {} | {:.1} | {:+.2} | {:+.1}% | {:.1}% | {:.1} | {:+.1} | {:+.1}% | {:.1}% | {:.1} | {:+.1}% | {:.1}% |",
                    seg.generation, r.from_s, r.to_s, r.samples, r.mean, r.slope_per_hour,
                    r.drift_pct, r.max_dev_pct, f.mean, f.slope_per_hour, f.drift_pct,
                    f.max_dev_pct, h.mean, h.drift_pct, h.max_dev_pct
                );
            }
            _ => {
                let _ = writeln!(
                    md,
                    "| gen {} | too short to judge |||||||||||||",
                    seg.generation
                );
            }
        }
    }

    md.push_str("\n## prefixlb processes\n\n| Gen | PID | Started (s) | Told to quit (s) | Exited (s) | Exit |\n|---|---|---|---|---|---|\n");
    for g in &s.generations {
        let _ = writeln!(
            md,
            "| {} | {} | {:.1} | {} | {} | {} |",
            g.index,
            g.pid,
            g.started_s,
            secs(g.quit_s),
            secs(g.exit.as_ref().map(|e| e.at_s)),
            g.exit.as_ref().map_or("running", |e| e.status.as_str())
        );
    }

    md.push_str("\n## Disturbances\n\n| At (s) | What | Outcome |\n|---|---|---|\n");
    let mut rows: Vec<(f64, String, String)> = Vec::new();
    for k in &s.timeline.kills {
        let running = k.running_before.map_or("?".into(), |r| format!("{r:.0}"));
        let outcome = match (&k.error, k.back_s) {
            (Some(e), _) => format!("not restarted: {e}"),
            (None, Some(b)) => format!("back at {b:.1} s"),
            (None, None) => "not restarted".into(),
        };
        rows.push((
            k.at_s,
            format!("SIGKILL engine {} ({running} running)", k.engine),
            outcome,
        ));
    }
    for p in &s.timeline.peers {
        let outcome = p
            .applied_ms
            .map_or("not listed by prefixlb within 10 s".into(), |ms| {
                format!("listed after {ms} ms")
            });
        rows.push((p.at_s, format!("peers file: {}", p.what), outcome));
    }
    for u in &s.timeline.upgrades {
        let outcome = match (&u.error, u.took_over_ms) {
            (Some(e), _) => format!("failed: {e}"),
            (None, Some(ms)) => format!("took over in {ms} ms"),
            (None, None) => "?".into(),
        };
        rows.push((u.at_s, format!("upgrade to gen {}", u.generation), outcome));
    }
    rows.sort_by(|a, b| a.0.total_cmp(&b.0));
    for (at, what, outcome) in rows {
        let _ = writeln!(md, "| {at:.1} | {} | {} |", cell(&what), cell(&outcome));
    }

    let _ = writeln!(md, "\n## Failed requests ({})\n", s.failures.len());
    if !s.failures.is_empty() {
        md.push_str("| Failed at (s) | Request | Engine | Kill | Cause | Tokens | prefixlb's access log | Near |\n|---|---|---|---|---|---|---|---|\n");
        for f in s.failures.iter().take(max_failures) {
            let kill = match (f.cut_by_kill, f.tied_by) {
                (Some(k), Some(by)) => format!(
                    "cut by kill of {} at {:.1} s (by {by})",
                    s.timeline.kills[k].engine, s.timeline.kills[k].at_s
                ),
                _ => "**lost**".into(),
            };
            let _ = writeln!(
                md,
                "| {:.2} | {} | {} | {} | {} | {} | {} | {} |",
                f.failure.failed_s,
                f.failure.request_id,
                f.failure.engine.as_deref().unwrap_or("?"),
                kill,
                cell(&f.failure.cause.to_string()),
                f.failure.tokens,
                cell(f.logged.as_deref().unwrap_or("no line")),
                cell(&f.near.join("; ")),
            );
        }
        if s.failures.len() > max_failures {
            let _ = writeln!(md, "\n{} more in soak.md.", s.failures.len() - max_failures);
        }
    }

    let a = &s.access_logs;
    let statuses: Vec<String> = a
        .by_status
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect();
    let _ = writeln!(
        md,
        "\n## prefixlb's logs\n\nAccess logs: {} lines ({}), {} naming an error; {} not \
         matching a failure a client saw.\n",
        a.lines,
        statuses.join(", "),
        a.with_error,
        a.unexplained.len()
    );
    for line in a.unexplained.iter().take(10) {
        let _ = writeln!(md, "- `{}`", line.replace('`', "'"));
    }
    if s.log_problems.is_empty() {
        md.push_str("No WARN or ERROR line.\n");
    } else {
        md.push_str("\n| Gen | Count | WARN/ERROR (numbers masked) |\n|---|---|---|\n");
        for p in s.log_problems.iter().take(40) {
            let _ = writeln!(
                md,
                "| {} | {} | {} |",
                p.generation,
                p.count,
                cell(&p.message)
            );
        }
    }
    let _ = writeln!(md, "\nRun files: {}", s.run_dir.display());
    md
}
