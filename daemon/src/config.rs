//! Command line and environment configuration, validated before anything binds.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use clap::Parser;

/// Name of the data-plane socket inside the socket directory.
pub const DATA_SOCKET: &str = "packd.sock";
/// Name of the control-plane socket inside the socket directory.
pub const CONTROL_SOCKET: &str = "control.sock";

/// packd — packs model weights once per host into sealed shared memory and serves them to
/// inference processes over a Unix socket.
///
/// Runs in the foreground. Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=packd=debug) for
/// more detail. Stop it with SIGTERM or Ctrl-C.
#[derive(Debug, Parser)]
#[command(name = "packd", version, about, long_about)]
pub struct Args {
    /// Directory for the sockets packd.sock (data plane) and control.sock (gRPC control
    /// plane). Default: $PACKD_SOCKET_DIR, else $RUNTIME_DIRECTORY (set by systemd), else
    /// /run/packd when writable, else $XDG_RUNTIME_DIR/packd. Created if missing.
    #[arg(long, value_name = "DIR", env = "PACKD_SOCKET_DIR")]
    pub socket_dir: Option<PathBuf>,

    /// Number of source files whose digest is remembered by (device, inode, size, mtime,
    /// ctime), so that a worker sending the same file again does not wait for hashing.
    #[arg(long, value_name = "N", default_value_t = 4096, env = "PACKD_DIGEST_CACHE")]
    pub digest_cache: usize,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Socket directory.
    pub socket_dir: PathBuf,
    /// Digest cache capacity.
    pub digest_cache: usize,
}

impl Config {
    /// Validates parsed arguments.
    pub fn from_args(args: Args) -> Result<Self, String> {
        let socket_dir = match args.socket_dir {
            Some(d) if d.as_os_str().is_empty() => return Err("--socket-dir must not be empty".into()),
            Some(d) => d,
            None => default_socket_dir().ok_or(
                "no socket directory: set --socket-dir, PACKD_SOCKET_DIR, RUNTIME_DIRECTORY or XDG_RUNTIME_DIR, or make /run/packd writable",
            )?,
        };
        if args.digest_cache == 0 {
            return Err("--digest-cache must be at least 1".into());
        }
        Ok(Self {
            socket_dir,
            digest_cache: args.digest_cache,
        })
    }

    /// Path of the data socket.
    pub fn data_socket(&self) -> PathBuf {
        self.socket_dir.join(DATA_SOCKET)
    }

    /// Path of the control socket.
    pub fn control_socket(&self) -> PathBuf {
        self.socket_dir.join(CONTROL_SOCKET)
    }
}

fn writable(dir: &Path) -> bool {
    nix::unistd::access(dir, nix::unistd::AccessFlags::W_OK).is_ok()
}

/// The daemon's default socket directory (see `--socket-dir`).
pub fn default_socket_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("RUNTIME_DIRECTORY").filter(|d| !d.is_empty()) {
        // systemd may list several directories separated by ':'; the first is ours.
        let first = d.to_string_lossy().split(':').next().unwrap_or_default().to_string();
        return Some(PathBuf::from(first));
    }
    let run = Path::new("/run/packd");
    if (run.is_dir() && writable(run)) || (!run.exists() && writable(Path::new("/run"))) {
        return Some(run.to_path_buf());
    }
    std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d).join("packd"))
}
