//! The TTFT distributions, one panel per workload and model, of each one's first seed (in the
//! first run, when the seeds ran more than once).

use plotters::prelude::*;

use crate::routers::ROUTERS;
use crate::runner::RunResult;
use crate::setup::MODELS;
use crate::workload::SHAPES;

pub fn draw(
    results: &[RunResult],
    path: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let shapes = SHAPES
        .into_iter()
        .filter(|s| results.iter().any(|r| r.shape == *s));
    let panels: Vec<_> = MODELS
        .into_iter()
        .flat_map(|m| shapes.clone().map(move |s| (m, s)))
        .filter(|(m, s)| results.iter().any(|r| r.shape == *s && r.model == *m))
        .collect();
    let columns = panels.len().clamp(1, 5);
    let lines = panels.len().div_ceil(columns).max(1);
    let root =
        SVGBackend::new(path, (300 * columns as u32, 520 * lines as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    let colors = [
        RED,
        RGBColor(255, 140, 0),
        RGBColor(180, 0, 120),
        RGBColor(120, 120, 120),
        BLUE,
        CYAN,
        GREEN,
        BLACK,
        RGBColor(140, 90, 40),
        MAGENTA,
        RGBColor(0, 120, 60),
        RGBColor(90, 0, 200),
        RGBColor(200, 170, 0),
        RGBColor(0, 160, 200),
        RGBColor(255, 100, 140),
    ];
    for (panel, (model, shape)) in root.split_evenly((lines, columns)).iter().zip(&panels) {
        let here = |r: &&RunResult| r.shape == *shape && r.model == *model;
        let first = results.iter().filter(here).map(|r| r.seed).min();
        let runs: Vec<&RunResult> = results
            .iter()
            .filter(here)
            .filter(|r| Some(r.seed) == first && r.run == 0)
            .collect();
        let max_ttft = runs.iter().flat_map(|r| r.ttfts()).fold(1.0, f64::max);
        let mut cdf = ChartBuilder::on(panel)
            .caption(
                format!(
                    "{} on {}, seed {}: TTFT (CDF)",
                    shape.name(),
                    model.name(),
                    first.unwrap_or_default()
                ),
                ("sans-serif", 14),
            )
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(40)
            .build_cartesian_2d((5f64..max_ttft * 1.1).log_scale(), 0f64..1f64)?;
        cdf.configure_mesh()
            .x_desc("ms, log scale")
            .y_desc("fraction of requests")
            .draw()?;
        for r in runs {
            let color =
                colors[ROUTERS.iter().position(|x| *x == r.router).unwrap_or(0) % colors.len()];
            let t = r.ttfts();
            let n = t.len().max(1) as f64;
            cdf.draw_series(LineSeries::new(
                t.iter()
                    .enumerate()
                    .map(|(i, v)| (v.max(5.0), (i + 1) as f64 / n)),
                color.stroke_width(2),
            ))?
            .label(r.router.name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        }
        cdf.configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
