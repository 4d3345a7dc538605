//! SVG plots of the benchmarks (plotters).

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

use super::attach::AttachResult;
use super::memory::MemoryResult;

/// A named, coloured line computed from one result row.
type Series<'a, R> = (&'a str, RGBColor, Box<dyn Fn(&R) -> f64>);

/// attach.svg: p50 and p99 latency of packd and the floor against the client count.
pub fn attach(dir: &Path, results: &[AttachResult]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("attach.svg");
    let root = SVGBackend::new(&path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let xs: Vec<f64> = results.iter().map(|r| (r.clients as f64).log2()).collect();
    let all: Vec<f64> = results
        .iter()
        .flat_map(|r| {
            [r.packd.quantile_us(0.5), r.packd.quantile_us(0.99), r.floor.quantile_us(0.5), r.floor.quantile_us(0.99)]
        })
        .collect();
    let ymax = all.iter().copied().fold(1.0, f64::max) * 1.5;
    let ymin = all.iter().copied().fold(f64::INFINITY, f64::min).max(0.1) / 1.5;
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
    let series: [Series<'_, AttachResult>; 4] = [
        ("packd p50", BLUE, Box::new(|r| r.packd.quantile_us(0.5))),
        ("packd p99", CYAN, Box::new(|r| r.packd.quantile_us(0.99))),
        ("floor p50", RED, Box::new(|r| r.floor.quantile_us(0.5))),
        ("floor p99", MAGENTA, Box::new(|r| r.floor.quantile_us(0.99))),
    ];
    for (name, color, f) in series {
        let pts: Vec<(f64, f64)> = xs.iter().copied().zip(results.iter().map(&f)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present().context("writing attach.svg")?;
    Ok(())
}

/// memory.svg: weights memory of N holders through packd and in the baseline.
pub fn memory(dir: &Path, results: &[MemoryResult]) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("memory.svg");
    let root = SVGBackend::new(&path, (800, 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let mb = |b: u64| b as f64 / (1024.0 * 1024.0);
    let xmax = results.iter().map(|r| r.procs).max().unwrap_or(1) as f64;
    let ymax = results.iter().map(|r| mb(r.baseline_pss_total.max(r.baseline_weights_pss))).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("memory of N processes holding one model", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..xmax + 0.5, 0.0..ymax)?;
    chart.configure_mesh().x_desc("processes").y_desc("MiB (Σ Pss)").draw()?;
    let series: [Series<'_, MemoryResult>; 4] = [
        ("packd weights (Pss_Shmem)", BLUE, Box::new(move |r| mb(r.weights_pss))),
        ("packd total", CYAN, Box::new(move |r| mb(r.pss_total))),
        ("baseline weights (Pss_Anon)", RED, Box::new(move |r| mb(r.baseline_weights_pss))),
        ("baseline total", MAGENTA, Box::new(move |r| mb(r.baseline_pss_total))),
    ];
    for (name, color, f) in series {
        let pts: Vec<(f64, f64)> = results.iter().map(|r| (r.procs as f64, f(r))).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present().context("writing memory.svg")?;
    Ok(())
}
