//! SVG plots of the benchmarks (plotters). Plain figures in, a file out: this module
//! knows nothing of the benchmarks that call it.

use std::path::Path;

use anyhow::Context;
use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;

/// One named line: a y for each x of the plot.
pub struct Line<'a> {
    /// Legend text.
    pub name: &'a str,
    /// One value per x.
    pub ys: Vec<f64>,
}

/// Colours of the lines, in order.
const PALETTE: [RGBColor; 4] = [BLUE, CYAN, RED, MAGENTA];

/// attach.svg: latency quantiles (µs, log scale) against the client count (log2 axis).
pub fn attach(dir: &Path, clients: &[usize], lines: &[Line<'_>]) -> anyhow::Result<()> {
    let path = dir.join("attach.svg");
    let root = canvas(dir, &path)?;
    let xs: Vec<f64> = clients.iter().map(|&c| (c as f64).log2()).collect();
    let all = lines.iter().flat_map(|l| l.ys.iter().copied());
    let ymax = all.clone().fold(1.0, f64::max) * 1.5;
    let ymin = all.fold(f64::INFINITY, f64::min).max(0.1) / 1.5;
    let xmax = xs.last().copied().unwrap_or(1.0).max(1.0);
    let mut chart = ChartBuilder::on(&root)
        .caption("attach latency (get + map + release) vs clients", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.2..xmax + 0.2, (ymin..ymax).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("client processes (log2)")
        .y_desc("µs")
        .x_label_formatter(&|x| format!("{:.0}", 2f64.powf(*x)))
        .draw()?;
    draw_lines(&mut chart, &xs, lines)?;
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present().context("writing attach.svg")?;
    Ok(())
}

/// memory.svg: memory (MiB) against the process count.
pub fn memory(dir: &Path, procs: &[usize], lines: &[Line<'_>]) -> anyhow::Result<()> {
    let path = dir.join("memory.svg");
    let root = canvas(dir, &path)?;
    let xs: Vec<f64> = procs.iter().map(|&p| p as f64).collect();
    let xmax = xs.iter().copied().fold(1.0, f64::max);
    let ymax = lines.iter().flat_map(|l| l.ys.iter().copied()).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("memory of N processes holding one model", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..xmax + 0.5, 0.0..ymax)?;
    chart.configure_mesh().x_desc("processes").y_desc("MiB (Σ Pss)").draw()?;
    draw_lines(&mut chart, &xs, lines)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present().context("writing memory.svg")?;
    Ok(())
}

/// An 800×500 white SVG canvas at `path` (its directory created).
fn canvas<'a>(dir: &Path, path: &'a Path) -> anyhow::Result<DrawingArea<SVGBackend<'a>, Shift>> {
    std::fs::create_dir_all(dir)?;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    Ok(root)
}

/// Draws each line (with dots at its points and a legend entry) in the palette's order.
fn draw_lines<X, Y>(
    chart: &mut ChartContext<'_, SVGBackend<'_>, Cartesian2d<X, Y>>,
    xs: &[f64],
    lines: &[Line<'_>],
) -> anyhow::Result<()>
where
    X: Ranged<ValueType = f64> + ValueFormatter<f64>,
    Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    for (line, color) in lines.iter().zip(PALETTE.iter().cycle().copied()) {
        let pts: Vec<(f64, f64)> = xs.iter().copied().zip(line.ys.iter().copied()).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(line.name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    Ok(())
}
