//! The stand-in service manager ([`packd_testkit::supervisor`]) wired to the test helpers.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;

pub use packd_testkit::supervisor::Manager;

/// A stand-in service manager with its notify socket in `dir`.
pub fn manager(dir: &Path) -> Manager {
    Manager::new(dir).expect("bind the notify socket")
}

use crate::bins::packd_bin;
use crate::daemon::Daemon;

/// The two listening sockets of the socket units, bound in `dir`.
pub fn sockets(dir: &Path) -> Vec<(String, OwnedFd)> {
    packd_testkit::supervisor::sockets(dir).expect("bind sockets")
}

/// A command that starts the built packd under `manager` with `fds`.
pub fn command(
    manager: &Manager,
    fds: Vec<(String, OwnedFd)>,
    env: &[(&str, &str)],
    args: &[&str],
) -> std::process::Command {
    manager.command(&packd_bin(), fds, env, args).expect("pass fds")
}

/// Starts packd under `manager` in `home` with its sockets (kept by the caller, as systemd
/// keeps them across restarts) and the manager's stored fds; waits for `READY=1`.
pub fn start(
    manager: &Manager,
    home: Arc<tempfile::TempDir>,
    sockets: &[(String, OwnedFd)],
    env: &[(&str, &str)],
    args: &[&str],
) -> Daemon {
    let before = manager.messages().len();
    let mut fds: Vec<(String, OwnedFd)> =
        sockets.iter().map(|(n, fd)| (n.clone(), fd.try_clone().expect("dup socket"))).collect();
    fds.extend(manager.stored().expect("dup stored fds"));
    let cmd = command(manager, fds, env, args);
    let d = Daemon::spawn(home, cmd);
    assert!(manager.wait_line(before, "READY=1").is_some(), "no READY=1; log:\n{}", d.log());
    d
}
