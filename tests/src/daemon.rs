//! A real `packd` started for a test.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::bins::{bin_dir, packctl_bin, packd_bin};
use packd_testkit::wait_until;

/// Ends the hold of a [`Daemon::holder_until_released`] holder (closes its standard input).
pub fn release(holder: &mut Child) {
    drop(holder.stdin.take());
}

/// How long [`Daemon::start`] waits for a daemon that is still running to serve: generous,
/// for a loaded machine (a daemon that exits fails at once).
pub const START_TIMEOUT: Duration = Duration::from_secs(120);

/// The kernels file test daemons share (`target/<profile>/packd-test-kernels/kernels`).
pub fn shared_kernels_file() -> PathBuf {
    bin_dir().join("packd-test-kernels").join("kernels")
}

/// A running `packd` in a temporary socket directory; killed on drop. The directory
/// outlives the daemon while any [`Daemon`] started in it (or a clone of [`Daemon::home`])
/// exists, so a test can restart a daemon in the same place.
pub struct Daemon {
    child: Child,
    dir: std::sync::Arc<tempfile::TempDir>,
    /// A control-plane connection for [`Daemon::stat`], made on first use.
    control: std::sync::Mutex<Option<Control>>,
}

/// A gRPC connection to a daemon's control socket with the runtime that drives it.
struct Control {
    runtime: tokio::runtime::Runtime,
    client: packd_proto::v1::control_client::ControlClient<tonic::transport::Channel>,
}

impl Control {
    fn connect(dir: &Path) -> Result<Self, String> {
        // A worker thread drives the connection between calls, so the daemon's GOAWAY at
        // shutdown is answered by closing it (a connection nobody drives would hold the
        // daemon's graceful shutdown for its whole timeout).
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let path = dir.join(packd_proto::CONTROL_SOCKET);
        let endpoint =
            tonic::transport::Endpoint::from_shared(format!("unix://{}", path.display())).map_err(|e| e.to_string())?;
        let channel = runtime.block_on(endpoint.connect()).map_err(|e| e.to_string())?;
        Ok(Self { runtime, client: packd_proto::v1::control_client::ControlClient::new(channel) })
    }

    fn stats(&mut self) -> Result<packd_proto::v1::Stats, String> {
        let call = self.client.get_stats(packd_proto::v1::GetStatsRequest {});
        self.runtime.block_on(call).map(tonic::Response::into_inner).map_err(|e| e.to_string())
    }
}

/// `packd` as tests start it: with no cache directory unless the caller sets
/// `PACKD_CACHE_DIR` (or passes `--cache-dir`, which wins), and the shared kernel
/// measurement ([`shared_kernels_file`]) unless it sets `PACKD_KERNELS_FILE`. The caller
/// adds `--socket-dir`: no test daemon uses the host's default directories.
pub fn packd_command() -> Command {
    let mut cmd = Command::new(packd_bin());
    own_places(&mut cmd);
    cmd
}

fn own_places(cmd: &mut Command) {
    if !cmd.get_envs().any(|(k, _)| k == "PACKD_CACHE_DIR") {
        cmd.env("PACKD_CACHE_DIR", "off");
    }
    if !cmd.get_envs().any(|(k, _)| k == "PACKD_KERNELS_FILE") {
        cmd.env("PACKD_KERNELS_FILE", shared_kernels_file());
    }
}

impl Daemon {
    /// Starts `packd --socket-dir <fresh temp dir>` and waits until both sockets accept.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Like [`Daemon::start`], with extra environment variables.
    pub fn start_with(env: &[(&str, &str)]) -> Self {
        Self::start_args(env, &[])
    }

    /// Like [`Daemon::start`], with extra environment variables and arguments.
    pub fn start_args(env: &[(&str, &str)], args: &[&str]) -> Self {
        Self::start_in(std::sync::Arc::new(tempfile::tempdir().expect("tempdir")), env, args)
    }

    /// Starts packd with `config` as its config file (`DIR/packd.toml`), e.g. a `[limits]`
    /// table.
    pub fn start_config(config: &str) -> Self {
        let dir = std::sync::Arc::new(tempfile::tempdir().expect("tempdir"));
        let file = dir.path().join("packd.toml");
        std::fs::write(&file, config).expect("write config");
        let file = file.to_str().expect("utf-8 path").to_string();
        Self::start_in(dir, &[], &["--config", &file])
    }

    /// Starts `packd --socket-dir DIR ARGS…` in an existing directory (a restart).
    pub fn start_in(dir: std::sync::Arc<tempfile::TempDir>, env: &[(&str, &str)], args: &[&str]) -> Self {
        let mut cmd = Command::new(packd_bin());
        cmd.args(args).envs(env.iter().copied()).arg("--socket-dir").arg(dir.path());
        Self::start_cmd(dir, cmd)
    }

    /// Starts `cmd` (a packd bound to `dir`, or a wrapper that execs one) and waits until it
    /// serves.
    pub fn start_cmd(dir: std::sync::Arc<tempfile::TempDir>, cmd: Command) -> Self {
        // The log is shared by restarts in one directory: count this start's line.
        let serving = |dir: &Path| {
            std::fs::read_to_string(dir.join("packd.log")).unwrap_or_default().matches("packd serving").count()
        };
        let before = serving(dir.path());
        let mut d = Self::spawn(dir, cmd);
        // Sockets accept (into the backlog) as soon as they are bound, before warm state is
        // adopted; "packd serving" is logged once it is. A daemon that exits fails at once;
        // one that is merely slow (a loaded machine) has two minutes.
        let mut exited = None;
        let ok = wait_until(START_TIMEOUT, || {
            exited = d.child.try_wait().ok().flatten();
            exited.is_some()
                || (serving(d.dir.path()) > before
                    && UnixStream::connect(d.dir.path().join("packd.sock")).is_ok()
                    && UnixStream::connect(d.dir.path().join("control.sock")).is_ok())
        });
        if let Some(status) = exited {
            panic!("packd exited before serving ({status}); log:\n{}", d.log());
        }
        assert!(ok, "packd did not serve within {START_TIMEOUT:?}; log:\n{}", d.log());
        d
    }

    /// Spawns `cmd` (a packd, or a wrapper that execs one) with its log appended to
    /// `DIR/packd.log`; does not wait for it to serve.
    ///
    /// Unless the command sets `PACKD_CACHE_DIR` (or passes `--cache-dir`, which wins), the
    /// daemon runs without a cache directory: tests must not share the user's default one.
    /// Unless it sets `PACKD_KERNELS_FILE`, it keeps its kernel measurement in the one file
    /// every test daemon shares ([`shared_kernels_file`]): on a CPU with two SIMD ISAs the
    /// first daemon measures, the others read it.
    pub fn spawn(dir: std::sync::Arc<tempfile::TempDir>, mut cmd: Command) -> Self {
        own_places(&mut cmd);
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(dir.path().join("packd.log")).expect("log file");
        let child = cmd
            .env("RUST_LOG", "packd=debug")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn packd");
        Self { child, dir, control: std::sync::Mutex::new(None) }
    }

    /// The directory, shared: keep a clone to restart a daemon in it.
    pub fn home(&self) -> std::sync::Arc<tempfile::TempDir> {
        std::sync::Arc::clone(&self.dir)
    }

    /// Sends `signal` to the daemon.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid() as i32), signal).expect("kill");
    }

    /// SIGKILLs the daemon (a crash) and reaps it.
    pub fn crash(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the daemon to exit by itself (a watchdog kills it after 60 s).
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            if Instant::now() > end {
                self.crash();
                panic!("packd did not exit within 60 s; log:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends SIGTERM and waits for the exit status (a watchdog kills it after 60 s).
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        self.wait_exit()
    }

    /// The socket directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("packd.log")).unwrap_or_default()
    }

    /// Whether the daemon process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Number of open fds of the daemon, leaving out its spare memfd: a thread of its own
    /// allocates that ahead of the next pack job, at a moment of its choosing (after a
    /// baseline was taken, say), and it is no client's fd.
    pub fn fd_count(&self) -> usize {
        let spare = |e: &std::fs::DirEntry| {
            std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().starts_with("/memfd:packd:b3:spare"))
        };
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.filter_map(Result::ok).filter(|e| !spare(e)).count())
            .unwrap_or(0)
    }

    /// Number of open fds of the daemon, its spare memfd included: what its open-file limit
    /// counts.
    pub fn all_fd_count(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid())).map(|d| d.count()).unwrap_or(0)
    }

    /// The daemon's fd count once it has stopped changing: the server side of a connection a
    /// client just closed (a `packctl stats` that has exited, say) is closed a moment later, so
    /// a baseline taken at once may count it. Waits until the count is the same for 300 ms
    /// (at most 10 s) and returns the lowest count seen.
    pub fn settled_fd_count(&self) -> usize {
        let end = Instant::now() + Duration::from_secs(10);
        let mut lowest = self.fd_count();
        let mut last = (lowest, Instant::now());
        while Instant::now() < end && last.1.elapsed() < Duration::from_millis(300) {
            std::thread::sleep(Duration::from_millis(20));
            let now = self.fd_count();
            lowest = lowest.min(now);
            if now != last.0 {
                last = (now, Instant::now());
            }
        }
        lowest
    }

    /// `packctl --socket-dir DIR ARGS…` (waits for it).
    pub fn packctl(&self, args: &[&str]) -> Output {
        self.packctl_cmd(args).output().expect("run packctl")
    }

    /// A `packctl` command bound to this daemon, not yet started.
    pub fn packctl_cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(packctl_bin());
        cmd.arg("--socket-dir").arg(self.dir()).args(args);
        cmd
    }

    /// Starts `packctl map FILE --touch EXTRA…` and returns once it has mapped the model
    /// (its first output line), so its lease exists.
    pub fn holder(&self, file: &str, extra: &[&str]) -> Child {
        let mut args = vec!["map", file, "--touch"];
        args.extend_from_slice(extra);
        self.holder_cmd(self.packctl_cmd(&args))
    }

    /// Starts `packctl map FILE --touch --hold-stdin EXTRA…` and returns once it has mapped
    /// the model: it holds its lease until [`release`] closes its standard input.
    pub fn holder_until_released(&self, file: &str, extra: &[&str]) -> Child {
        let mut args = vec!["map", file, "--touch", "--hold-stdin"];
        args.extend_from_slice(extra);
        let mut cmd = self.packctl_cmd(&args);
        cmd.stdin(Stdio::piped());
        self.holder_cmd(cmd)
    }

    fn holder_cmd(&self, mut cmd: Command) -> Child {
        let mut child = cmd.stdout(Stdio::piped()).spawn().expect("spawn packctl map");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.as_mut().expect("stdout")), &mut line)
            .expect("read packctl map output");
        assert!(line.starts_with("mapped:"), "packctl map: {line}");
        child
    }

    /// `packctl stats --json`, parsed.
    pub fn stats(&self) -> serde_json::Value {
        let out = self.packctl(&["stats", "--json"]);
        assert!(out.status.success(), "stats failed: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("stats json")
    }

    /// One counter of GetStats, by its field name, over a control-plane connection kept
    /// for the next call (cheap enough to poll; a restarted daemon gets a new connection).
    pub fn stat(&self, key: &str) -> u64 {
        let mut control = self.control.lock().unwrap_or_else(|p| p.into_inner());
        let stats = match control.as_mut().map(Control::stats) {
            Some(Ok(stats)) => stats,
            _ => {
                let mut fresh = Control::connect(self.dir()).unwrap_or_else(|e| panic!("control connection: {e}"));
                let stats = fresh.stats().unwrap_or_else(|e| panic!("GetStats: {e}"));
                *control = Some(fresh);
                stats
            }
        };
        match key {
            "entries" => stats.entries,
            "segments" => stats.segments,
            "leases" => stats.leases,
            "clients" => stats.clients,
            "pack_jobs" => stats.pack_jobs,
            "hits" => stats.hits,
            "misses" => stats.misses,
            "bytes_resident" => stats.bytes_resident,
            "pack_failures" => stats.pack_failures,
            "request_errors" => stats.request_errors,
            "budget_bytes" => stats.budget_bytes,
            "zombie_bytes" => stats.zombie_bytes,
            "spare_bytes" => stats.spare_bytes,
            "spare_takes" => stats.spare_takes,
            "evictions" => stats.evictions,
            "log_lines_suppressed" => stats.log_lines_suppressed,
            "connections_refused" => stats.connections_refused,
            "connections_shed" => stats.connections_shed,
            "control_connections" => stats.control_connections,
            "control_connections_refused" => stats.control_connections_refused,
            "published_segments" => stats.published_segments,
            "published_bytes" => stats.published_bytes,
            "builds" => stats.builds,
            "build_waits" => stats.build_waits,
            "builds_abandoned" => stats.builds_abandoned,
            "builds_expired" => stats.builds_expired,
            "builds_given_up" => stats.builds_given_up,
            "build_waits_slow" => stats.build_waits_slow,
            "lent_bytes" => stats.lent_bytes,
            "builds_lent" => stats.builds_lent,
            "lends_refused" => stats.lends_refused,
            "lends_revoked" => stats.lends_revoked,
            "lends_expired" => stats.lends_expired,
            "reserved_bytes" => stats.reserved_bytes,
            "private_reports" => stats.private_reports,
            "builds_active" => stats.builds_active,
            "builds_refused" => stats.builds_refused,
            "publishes" => stats.publishes,
            "publishes_refused" => stats.publishes_refused,
            "publishes_withdrawn" => stats.publishes_withdrawn,
            "aliases_filed" => stats.aliases_filed,
            "source_hashes" => stats.source_hashes,
            "duplicates_dropped" => stats.duplicates_dropped,
            other => panic!("GetStats has no counter {other}"),
        }
    }

    /// A client library connection.
    pub fn client(&self) -> packd_client::Client {
        packd_client::Client::connect(self.dir()).expect("connect")
    }

    /// A raw data-plane connection.
    pub fn raw(&self) -> UnixStream {
        let s = UnixStream::connect(self.dir().join("packd.sock")).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        s
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
