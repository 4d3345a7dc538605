//! The `packd` daemon binary: parse and validate configuration, set up logging, run.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use packd::config::{Args, Config};

/// Exit code for bad configuration or usage (`RestartPreventExitStatus=64` in the unit).
const EXIT_USAGE: u8 = 64;

/// Parses the command line; `--version` also names the packing ISAs of this CPU.
fn parse_args() -> Result<Args, clap::Error> {
    let isas: Vec<String> = packd::pack::Isa::available().iter().map(ToString::to_string).collect();
    let version = format!(
        "{} (packing ISAs available: {}; by default the fastest per layout kind, measured when there is a choice)",
        env!("CARGO_PKG_VERSION"),
        isas.join(", ")
    );
    let matches = Args::command().version(version).try_get_matches()?;
    Args::from_arg_matches(&matches)
}

fn main() -> ExitCode {
    // First: the default of limits.max_segments follows the limit in effect.
    packd::sys::proc::raise_open_file_limit();
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) if e.use_stderr() => {
            let _ = e.print();
            return ExitCode::from(EXIT_USAGE);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    let config = match Config::from_args(args.clone()) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("packd: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if args.check_config {
        println!("configuration OK:\n{}", config.describe());
        println!("kernels: {}", packd::persist::kernels::preview(&config.isa, config.kernels_file.as_deref()));
        for warning in config.warnings().into_iter().chain(config.socket_mode_warning()).chain(config.socket_warning())
        {
            println!("warning: {warning}");
        }
        return ExitCode::SUCCESS;
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();

    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("packd: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let grace = config.shutdown_timeout;
    let result = runtime.block_on(packd::server::run(args, config));
    // Pack jobs still running past the drain are abandoned, not awaited.
    let down = std::time::Instant::now();
    runtime.shutdown_timeout(grace.min(std::time::Duration::from_secs(1)));
    match result {
        Ok(stopped) => {
            // The last line, once nothing runs any more.
            stopped.log(down.elapsed());
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!("{}", packd::server::chain(&e));
            if e.is_usage() { ExitCode::from(EXIT_USAGE) } else { ExitCode::FAILURE }
        }
    }
}
