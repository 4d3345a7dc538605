//! What packctl shows while the daemon packs: a progress bar on a terminal, plain lines
//! otherwise, and nothing for a pack that answers within a moment.

use std::cell::RefCell;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use packd_client::proto::{self, ProgressStage};

/// A pack answered within this shows no progress at all.
const QUIET_FOR: Duration = Duration::from_millis(500);
/// Plain lines (stderr not a terminal) come at most this often.
const LINE_EVERY: Duration = Duration::from_secs(5);

/// Shows the progress reports of one pack on stderr.
pub struct Reporter {
    what: String,
    started: Instant,
    tty: bool,
    state: RefCell<State>,
}

#[derive(Default)]
struct State {
    bar: Option<ProgressBar>,
    last_line: Option<Instant>,
}

fn stage_name(stage: i32) -> &'static str {
    match ProgressStage::try_from(stage) {
        Ok(ProgressStage::Waiting) => "waiting for another pack of it",
        Ok(ProgressStage::Hashing) => "hashing",
        Ok(ProgressStage::Packing) => "packing",
        _ => "queued",
    }
}

impl Reporter {
    /// A reporter for the pack of `what` (a file name), started now.
    pub fn new(what: &str) -> Self {
        Self {
            what: what.to_string(),
            started: Instant::now(),
            tty: std::io::stderr().is_terminal(),
            state: RefCell::default(),
        }
    }

    /// Takes one progress report.
    pub fn report(&self, p: &proto::Progress) {
        let elapsed = self.started.elapsed();
        if elapsed < QUIET_FOR {
            return;
        }
        let stage = stage_name(p.stage);
        let mut state = self.state.borrow_mut();
        if self.tty {
            let bar = state.bar.get_or_insert_with(|| {
                let bar = ProgressBar::new(p.bytes_total.max(1));
                let style = ProgressStyle::with_template(
                    "{prefix} {msg:<30} [{bar:30}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {elapsed}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> ");
                bar.set_style(style);
                bar.set_prefix(self.what.clone());
                bar
            });
            bar.set_length(p.bytes_total.max(1));
            bar.set_message(stage);
            bar.set_position(p.bytes_done);
        } else if state.last_line.is_none_or(|t| t.elapsed() >= LINE_EVERY) {
            state.last_line = Some(Instant::now());
            let bytes = if p.bytes_total > 0 {
                format!(
                    ": {} of {} MiB ({:.0} %)",
                    p.bytes_done >> 20,
                    p.bytes_total >> 20,
                    100.0 * p.bytes_done as f64 / p.bytes_total as f64
                )
            } else {
                String::new()
            };
            eprintln!("packctl: {}: {stage}{bytes}, {:.1} s", self.what, elapsed.as_secs_f64());
        }
    }

    /// Clears the bar (if one was shown).
    pub fn finish(&self) {
        if let Some(bar) = self.state.borrow_mut().bar.take() {
            bar.finish_and_clear();
        }
    }
}
