//! `packctl top`: a live view of what the host shares — totals, models by bytes, workers and
//! how they got their weights (private fallbacks with their reason) — refreshed every
//! interval over the control plane. Keys: `s` changes the models' sort order, `q` (or Esc,
//! or Ctrl-C) quits.

use std::path::Path;
use std::time::{Duration, Instant};

use packd_proto::units::format_size;
use packd_proto::v1 as pb;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Paragraph, Row, Table};

use crate::control::{connect, report_text, status};

/// How the models table is sorted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sort {
    Resident,
    Saved,
    Workers,
    Hits,
}

impl Sort {
    fn next(self) -> Self {
        match self {
            Self::Resident => Self::Saved,
            Self::Saved => Self::Workers,
            Self::Workers => Self::Hits,
            Self::Hits => Self::Resident,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Resident => "resident",
            Self::Saved => "saved",
            Self::Workers => "workers",
            Self::Hits => "hits",
        }
    }
}

/// One refresh's data.
struct View {
    stats: pb::Stats,
    models: Vec<pb::ModelStatus>,
    clients: Vec<pb::ClientStatus>,
}

async fn fetch(dir: &Path) -> anyhow::Result<View> {
    let mut c = connect(dir).await?;
    let stats = c.get_stats(pb::GetStatsRequest {}).await.map_err(status)?.into_inner();
    let models = c.list_models(pb::ListModelsRequest {}).await.map_err(status)?.into_inner().models;
    let clients = c.list_clients(pb::ListClientsRequest {}).await.map_err(status)?.into_inner().clients;
    Ok(View { stats, models, clients })
}

/// Runs the view until `q`. Refreshes every `interval`, each refresh given `timeout`.
pub fn run(dir: &Path, interval: Duration, timeout: Duration) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        anyhow::bail!(
            "packctl top needs a terminal (stdin and stdout); for scripts use `packctl stats --json`, \
             `packctl models --json` and `packctl clients --json`"
        );
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // Checked before the screen is taken: a daemon that is not there is said plainly.
    let mut view = rt.block_on(async { tokio::time::timeout(timeout, fetch(dir)).await }).map_err(|_| {
        anyhow::anyhow!("packd at {} did not answer in {} s (--timeout)", dir.display(), timeout.as_secs_f64())
    })??;
    let mut terminal = ratatui::init();
    let mut sort = Sort::Resident;
    let mut error: Option<String> = None;
    let mut next = Instant::now() + interval;
    let result = loop {
        if let Err(e) = terminal.draw(|f| draw(f, &view, sort, error.as_deref(), interval)) {
            break Err(e.into());
        }
        let wait = next.saturating_duration_since(Instant::now());
        match event::poll(wait) {
            Ok(true) => match event::read() {
                Ok(Event::Key(k)) if k.kind == KeyEventKind::Press => match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => break Ok(()),
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => break Ok(()),
                    KeyCode::Char('s') => sort = sort.next(),
                    _ => {}
                },
                Ok(_) => {}
                Err(e) => break Err(e.into()),
            },
            Ok(false) => {
                match rt.block_on(async { tokio::time::timeout(timeout, fetch(dir)).await }) {
                    Ok(Ok(v)) => {
                        view = v;
                        error = None;
                    }
                    Ok(Err(e)) => error = Some(format!("{e:#}")),
                    Err(_) => error = Some(format!("packd did not answer within {} s", timeout.as_secs_f64())),
                }
                next = Instant::now() + interval;
            }
            Err(e) => break Err(e.into()),
        }
    };
    ratatui::restore();
    result
}

fn draw(f: &mut ratatui::Frame, v: &View, sort: Sort, error: Option<&str>, interval: Duration) {
    let s = &v.stats;
    let [head, models, workers, foot] = Layout::vertical([
        Constraint::Length(7),
        // As tall as its rows, at most 40 % of the screen: the workers get the rest.
        Constraint::Length(
            u16::try_from(v.models.len() + 3).unwrap_or(u16::MAX).min(f.area().height.saturating_mul(2) / 5).max(4),
        ),
        Constraint::Fill(1),
        Constraint::Length(1),
    ])
    .areas(f.area());
    let mut fallbacks: Vec<(&String, &u64)> = s.private_fallbacks.iter().filter(|(_, n)| **n > 0).collect();
    fallbacks.sort_by(|a, b| b.1.cmp(a.1));
    let fallbacks = if fallbacks.is_empty() {
        "none".to_string()
    } else {
        fallbacks.iter().map(|(r, n)| format!("{r} {n}")).collect::<Vec<_>>().join(", ")
    };
    // Each line fits 80 columns with the figures of a busy host.
    let lines = vec![
        Line::from(format!(
            "saved {}  (mapped {}, resident {} of {} budget)",
            format_size(s.bytes_saved),
            format_size(s.bytes_mapped),
            format_size(s.bytes_resident),
            format_size(s.budget_bytes),
        )),
        Line::from(format!(
            "workers {}: served {}  building {}  private {} ({} held privately)",
            s.clients,
            s.workers_served,
            s.workers_building,
            s.workers_private,
            format_size(s.private_bytes)
        )),
        Line::from(format!(
            "segments {}  hits {}  misses {}  pack jobs {}  evictions {}",
            s.segments, s.hits, s.misses, s.pack_jobs, s.evictions
        )),
        Line::from(format!("kernels {}", crate::stats::kernels(s))),
        Line::from(format!("private fallbacks: {fallbacks}")),
    ];
    f.render_widget(Paragraph::new(lines).block(Block::bordered().title(" packd top ")), head);

    let mut ms: Vec<&pb::ModelStatus> = v.models.iter().collect();
    match sort {
        Sort::Resident => ms.sort_by_key(|m| std::cmp::Reverse(m.bytes_resident)),
        Sort::Saved => ms.sort_by_key(|m| std::cmp::Reverse(m.bytes_saved)),
        Sort::Workers => {
            ms.sort_by_key(|m| std::cmp::Reverse(m.workers_served + m.workers_building + m.workers_private))
        }
        Sort::Hits => ms.sort_by_key(|m| std::cmp::Reverse(m.hits)),
    }
    let rows = ms.iter().map(|m| {
        let name = if m.label.is_empty() { m.model.clone() } else { m.label.clone() };
        Row::new(vec![
            format_size(m.bytes_resident),
            format_size(m.bytes_mapped),
            format_size(m.bytes_saved),
            m.workers_served.to_string(),
            m.workers_building.to_string(),
            m.workers_private.to_string(),
            m.hits.to_string(),
            name,
        ])
    });
    let widths = [
        Constraint::Length(9),
        Constraint::Length(9),
        Constraint::Length(9),
        Constraint::Length(6),
        Constraint::Length(8),
        Constraint::Length(7),
        Constraint::Length(6),
        Constraint::Fill(1),
    ];
    let header = Row::new(vec!["resident", "mapped", "saved", "served", "building", "private", "hits", "model"])
        .style(Style::default().add_modifier(Modifier::BOLD));
    let title = format!(" models ({}, sorted by {}: s to change) ", v.models.len(), sort.name());
    f.render_widget(Table::new(rows, widths).header(header).block(Block::bordered().title(title)), models);

    let rows = v.clients.iter().map(|c| {
        // A worker that reports nothing (packctl, a plain client) is described by what the
        // daemon sees: its leases and builder roles.
        let how = if c.reports.is_empty() {
            match (c.leases, c.builds) {
                (0, 0) => String::new(),
                (0, _) => "building".to_string(),
                (n, _) => format!("served: {n} lease(s), no report"),
            }
        } else {
            c.reports.iter().map(report_text).collect::<Vec<_>>().join("; ")
        };
        Row::new(vec![
            c.pid.to_string(),
            c.uid.to_string(),
            c.leases.to_string(),
            format_size(c.bytes_mapped),
            c.builds.to_string(),
            how,
        ])
    });
    let widths = [
        Constraint::Length(8),
        Constraint::Length(6),
        Constraint::Length(6),
        Constraint::Length(10),
        Constraint::Length(6),
        Constraint::Fill(1),
    ];
    let header = Row::new(vec!["pid", "uid", "leases", "mapped", "builds", "how it got its weights (reported)"])
        .style(Style::default().add_modifier(Modifier::BOLD));
    let title = format!(" workers ({}) ", v.clients.len());
    f.render_widget(Table::new(rows, widths).header(header).block(Block::bordered().title(title)), workers);
    let status = match error {
        Some(e) => format!("error: {e} (showing the last answer)"),
        None => format!("refresh every {} s · s sort · q quit", interval.as_secs_f64()),
    };
    f.render_widget(Paragraph::new(status), foot);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's example: three `packctl map` workers of MiniLM and an XNNPACK worker
    /// that fell back.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    fn example() -> View {
        let mib = |x: f64| (x * 1_048_576.0) as u64;
        let mut stats = pb::Stats {
            bytes_saved: mib(173.3),
            bytes_mapped: mib(259.9),
            bytes_resident: mib(86.7),
            budget_bytes: mib(11.8 * 1024.0),
            clients: 4,
            workers_served: 3,
            workers_private: 1,
            private_bytes: mib(43.0),
            segments: 1,
            hits: 2,
            misses: 1,
            pack_jobs: 1,
            ..Default::default()
        };
        for (kind, isa) in
            [("f32-gemm", "avx2"), ("f16-gemm", "avx512"), ("bf16-gemm", "avx512"), ("qc8w-gemm", "avx2")]
        {
            stats.kernels.insert(kind.into(), isa.into());
        }
        stats.private_fallbacks.insert("unknown_interface".into(), 1);
        let minilm = pb::ModelStatus {
            model: "b3:5d3c…".into(),
            label: "model.safetensors".into(),
            segments: 1,
            bytes_resident: mib(86.7),
            bytes_mapped: mib(259.9),
            bytes_saved: mib(173.3),
            workers_served: 3,
            hits: 2,
            ..Default::default()
        };
        let xnnpack = "xnnpack;key=v1/64b;model=b3:77a1…";
        let fell_back = pb::ModelStatus { model: xnnpack.into(), workers_private: 1, ..Default::default() };
        let mapped = |pid| pb::ClientStatus { pid, leases: 1, bytes_mapped: mib(86.6), ..Default::default() };
        let report = pb::WorkerReport {
            engine: "xnnpack".into(),
            model: xnnpack.into(),
            obtained: pb::Obtained::Private.into(),
            fallback: pb::Fallback::UnknownInterface.into(),
            private_bytes: mib(43.0),
            ..Default::default()
        };
        let private = pb::ClientStatus {
            pid: 974,
            reports: vec![pb::WorkerStatus { report: Some(report), ..Default::default() }],
            ..Default::default()
        };
        View { stats, models: vec![minilm, fell_back], clients: vec![mapped(901), mapped(969), mapped(971), private] }
    }

    fn render(width: u16) -> String {
        let backend = ratatui::backend::TestBackend::new(width, 21);
        let mut terminal = ratatui::Terminal::new(backend).unwrap();
        terminal.draw(|f| draw(f, &example(), Sort::Resident, None, Duration::from_secs(1))).unwrap();
        let buffer = terminal.backend().buffer();
        let mut text = String::new();
        for y in 0..buffer.area.height {
            let line: String = (0..buffer.area.width).map(|x| buffer[(x, y)].symbol()).collect();
            text.push_str(line.trim_end());
            text.push('\n');
        }
        text
    }

    /// The block after `marker` in the README, lines trimmed at the end.
    fn readme_sample(marker: &str) -> String {
        let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap();
        let after = &readme[readme.find(marker).unwrap_or_else(|| panic!("no {marker} in the README"))..];
        let block = &after[after.find("```\n").unwrap() + 4..];
        let block = &block[..block.find("```").unwrap()];
        block.lines().map(|l| format!("{}\n", l.trim_end())).collect()
    }

    #[test]
    fn top_at_80_and_120_columns_is_what_the_readme_shows() {
        for width in [80, 120] {
            let drawn = render(width);
            assert!(drawn.lines().all(|l| l.chars().count() <= usize::from(width)), "{drawn}");
            assert!(drawn.contains("kernels avx2: f32-gemm qc8w-gemm · avx512: bf16-gemm f16-gemm"), "{drawn}");
            let marker = format!("<!-- packctl top at {width} columns -->");
            assert_eq!(drawn, readme_sample(&marker), "the README's sample at {width} columns; drawn:\n{drawn}");
        }
    }
}
