//! The TTFT distributions of every run, one panel per workload.

use plotters::prelude::*;

use crate::routers::ROUTERS;
use crate::runner::RunResult;
use crate::workload::{Shape, SHAPES};

pub fn draw(
    results: &[RunResult],
    path: &std::path::Path,
) -> Result<(), Box<dyn std::error::Error>> {
    let shapes: Vec<Shape> = SHAPES
        .into_iter()
        .filter(|s| results.iter().any(|r| r.shape == *s))
        .collect();
    let root = SVGBackend::new(path, (1500, 520)).into_drawing_area();
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
    ];
    for (panel, shape) in root
        .split_evenly((1, shapes.len().max(1)))
        .iter()
        .zip(&shapes)
    {
        let runs: Vec<&RunResult> = results.iter().filter(|r| r.shape == *shape).collect();
        let max_ttft = runs.iter().flat_map(|r| r.ttfts()).fold(1.0, f64::max);
        let mut cdf = ChartBuilder::on(panel)
            .caption(format!("{}: TTFT (CDF)", shape.name()), ("sans-serif", 18))
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
