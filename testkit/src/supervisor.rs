//! A stand-in for systemd's side of the service protocol, for tests and benchmarks on
//! machines where systemd does not run: a notification socket that records every message,
//! keeps the fds sent with `FDSTORE=1` under their `FDNAME=` and drops them on
//! `FDSTOREREMOVE=1`; and a launcher that starts packd with listening sockets and stored
//! fds in `LISTEN_FDS` / `LISTEN_FDNAMES`, as systemd does on a restart.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::wait::wait_until;

#[derive(Default)]
struct State {
    messages: Vec<String>,
    store: Vec<(String, OwnedFd)>,
}

/// The notification socket and fd store of a pretend service manager.
pub struct Manager {
    path: PathBuf,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Manager {
    /// Binds `DIR/notify` and starts recording.
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        let path = dir.join("notify");
        let sock = UnixDatagram::bind(&path)?;
        sock.set_read_timeout(Some(Duration::from_millis(50)))?;
        let state = Arc::new(Mutex::new(State::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (Arc::clone(&state), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            while !sp.load(Ordering::Relaxed) {
                let Ok(r) = packd_proto::sys::recv_with_fds(sock.as_fd(), &mut buf, false) else { continue };
                let text = String::from_utf8_lossy(&buf[..r.bytes]).into_owned();
                let field = |k: &str| text.lines().find_map(|l| l.strip_prefix(k)).map(str::to_string);
                let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
                if text.lines().any(|l| l == "FDSTORE=1") {
                    let name = field("FDNAME=").unwrap_or_else(|| "stored".into());
                    s.store.extend(r.fds.into_iter().map(|fd| (name.clone(), fd)));
                } else if text.lines().any(|l| l == "FDSTOREREMOVE=1") {
                    let name = field("FDNAME=").unwrap_or_default();
                    s.store.retain(|(n, _)| *n != name);
                }
                s.messages.push(text);
            }
        });
        Ok(Self { path, state, stop, thread: Some(thread) })
    }

    /// `NOTIFY_SOCKET` for the service.
    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// Every message so far.
    pub fn messages(&self) -> Vec<String> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).messages.clone()
    }

    /// Waits (up to `timeout`) until some message after the first `after` has a line
    /// starting with `line`. Returns its index.
    pub fn wait_line_for(&self, after: usize, line: &str, timeout: Duration) -> Option<usize> {
        let mut found = None;
        wait_until(timeout, || {
            found = self
                .messages()
                .iter()
                .enumerate()
                .skip(after)
                .find_map(|(i, m)| m.lines().any(|l| l.starts_with(line)).then_some(i));
            found.is_some()
        });
        found
    }

    /// [`Manager::wait_line_for`] with a 30 s timeout.
    pub fn wait_line(&self, after: usize, line: &str) -> Option<usize> {
        self.wait_line_for(after, line, Duration::from_secs(30))
    }

    /// Forgets every stored fd (as after a reboot, or `systemctl clean --what=fdstore`).
    pub fn clear_store(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).store.clear();
    }

    /// Names of the fds in the store, one per fd, sorted.
    pub fn stored_names(&self) -> Vec<String> {
        let mut names: Vec<String> =
            self.state.lock().unwrap_or_else(|p| p.into_inner()).store.iter().map(|(n, _)| n.clone()).collect();
        names.sort();
        names
    }

    /// The fds in the store, duplicated (the store keeps its own).
    pub fn stored(&self) -> std::io::Result<Vec<(String, OwnedFd)>> {
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.store.iter().map(|(n, fd)| Ok((n.clone(), fd.try_clone()?))).collect()
    }

    /// Puts an fd into the store as if the service had sent it.
    pub fn inject(&self, name: &str, fd: OwnedFd) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).store.push((name.to_string(), fd));
    }

    /// A command that starts `packd` with `args`, receiving `fds` (name, fd) through
    /// `LISTEN_FDS` and notifying this manager. `LISTEN_PID` must be packd's own pid, so a
    /// shell exports its pid and execs packd in place.
    pub fn command(
        &self,
        packd: &Path,
        fds: Vec<(String, OwnedFd)>,
        env: &[(&str, &str)],
        args: &[&str],
    ) -> std::io::Result<Command> {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg("export LISTEN_PID=$$; exec \"$0\" \"$@\"").arg(packd).args(args);
        let names: Vec<&str> = fds.iter().map(|(n, _)| n.as_str()).collect();
        cmd.env("LISTEN_FDS", fds.len().to_string()).env("LISTEN_FDNAMES", names.join(":"));
        cmd.env("NOTIFY_SOCKET", &self.path).envs(env.iter().copied());
        let owned: Vec<OwnedFd> = fds.into_iter().map(|(_, fd)| fd).collect();
        crate::sys::pass_fds(&mut cmd, &owned)?;
        Ok(cmd)
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Binds the two listening sockets of `packd.socket` / `packd-control.socket` in `dir`,
/// named as packd expects (`data`, `control`). Kept by the caller across restarts, as
/// systemd keeps them.
pub fn sockets(dir: &Path) -> std::io::Result<Vec<(String, OwnedFd)>> {
    [packd_proto::DATA_SOCKET, packd_proto::CONTROL_SOCKET]
        .iter()
        .zip([packd_proto::DATA_FDNAME, packd_proto::CONTROL_FDNAME])
        .map(|(file, name)| {
            let _ = std::fs::remove_file(dir.join(file));
            let l = std::os::unix::net::UnixListener::bind(dir.join(file))?;
            Ok((name.to_string(), OwnedFd::from(l)))
        })
        .collect()
}
