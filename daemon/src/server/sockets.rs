//! The two listening sockets: adopted from systemd (socket activation, by
//! `FileDescriptorName=`), or bound by the daemon itself.

use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tokio::net::UnixListener;

use super::error::{ServerError, Step, Usage};
use crate::config::{Config, DEFAULT_SOCKET_GROUP};
use crate::sys::notify::{ListenFd, check_listening_unix_stream, socket_path};

/// `FileDescriptorName=` of the data-plane socket in `packd.socket`.
pub const DATA_NAME: &str = packd_proto::DATA_FDNAME;
/// `FileDescriptorName=` of the control-plane socket in `packd.socket`.
pub const CONTROL_NAME: &str = packd_proto::CONTROL_FDNAME;

/// A listening socket and whether the daemon owns its path (and removes it on exit).
pub struct Listener {
    /// The socket.
    pub listener: UnixListener,
    /// Its path, for logs.
    pub path: String,
    /// The path the daemon bound and removes on exit (`None` when systemd owns it).
    pub owned_path: Option<PathBuf>,
}

/// Binds a Unix socket at `path` with `mode` (and group `group`, if given), replacing a
/// stale socket file but never one another live daemon is serving.
pub fn bind(path: &Path, mode: u32, group: Option<u32>) -> Result<UnixListener, ServerError> {
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ServerError::Usage(Usage::SocketServed(path.to_path_buf())));
        }
        fs::remove_file(path).map_err(ServerError::io(Step::RemoveStale(path.to_path_buf())))?;
    }
    let listener = UnixListener::bind(path).map_err(ServerError::io(Step::Bind(path.to_path_buf())))?;
    if let Some(gid) = group {
        std::os::unix::fs::chown(path, None, Some(gid))
            .map_err(ServerError::io(Step::Chgrp { gid, path: path.to_path_buf() }))?;
    }
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(ServerError::io(Step::Chmod { mode, path: path.to_path_buf() }))?;
    Ok(listener)
}

fn adopt(name: &'static str, fd: OwnedFd) -> Result<Listener, ServerError> {
    if let Err(why) = check_listening_unix_stream(fd.as_fd()) {
        return Err(ServerError::Usage(Usage::PassedNotUnixStream { name, why }));
    }
    let path = socket_path(fd.as_fd());
    let std_listener = std::os::unix::net::UnixListener::from(fd);
    std_listener.set_nonblocking(true).map_err(ServerError::io(Step::Passed(name)))?;
    let listener = UnixListener::from_std(std_listener).map_err(ServerError::io(Step::Passed(name)))?;
    Ok(Listener { listener, path, owned_path: None })
}

fn bind_own(config: &Config, path: PathBuf) -> Result<Listener, ServerError> {
    let dir = config.socket_dir.as_path();
    if !dir.is_dir() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(ServerError::io(Step::SocketDir(dir.to_path_buf())))?;
    }
    let listener = bind(&path, config.socket_mode, config.socket_group)?;
    Ok(Listener { listener, path: path.display().to_string(), owned_path: Some(path) })
}

/// A warning when the data socket can be reached only by root: owner and group root
/// and no access for others (so a non-root worker gets "Permission denied"). `group` is the
/// configured socket group's name when one was set by name. A socket passed by socket
/// activation has the socket unit's owner and mode (`SocketGroup=`, `SocketMode=`).
fn reach_warning(path: &Path, group: Option<&str>, activated: bool) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(path).ok()?;
    if meta.uid() != 0 || meta.gid() != 0 || meta.mode() & 0o006 == 0o006 {
        return None;
    }
    let fix = match group {
        _ if activated => "only root can connect: the socket unit decides its group and mode (SocketGroup=, \
                           SocketMode= in packd.socket; socket_group and socket_mode do not apply to it)"
            .to_string(),
        Some(name) => format!("only root and members of group {name:?} can connect"),
        None => format!(
            "only root can connect, since there is no group {DEFAULT_SOCKET_GROUP:?}. Nothing to do if every \
             worker runs as root (a one-user machine); for workers of other users create the group (groupadd \
             --system {DEFAULT_SOCKET_GROUP}), add their users to it (usermod -aG {DEFAULT_SOCKET_GROUP} USER) \
             and restart packd, or set socket_group in the config file"
        ),
    };
    Some(format!("the data socket is root:root mode {:04o}: {fix}", meta.mode() & 0o777))
}

/// The name a metrics listener is passed under (`FileDescriptorName=metrics`).
pub const METRICS_NAME: &str = "metrics";

/// Takes the listening TCP socket passed as `metrics` (socket activation) out of `passed`.
pub fn take_metrics(passed: Vec<ListenFd>) -> Result<(Option<tokio::net::TcpListener>, Vec<ListenFd>), ServerError> {
    let (mut metrics, mut rest) = (None, Vec::new());
    for p in passed {
        if p.name != METRICS_NAME {
            rest.push(p);
            continue;
        }
        if metrics.is_some() {
            return Err(ServerError::Usage(Usage::PassedTwice(METRICS_NAME.into())));
        }
        let std = std::net::TcpListener::from(p.fd);
        let usable = std.set_nonblocking(true).and_then(|()| tokio::net::TcpListener::from_std(std));
        metrics = Some(usable.map_err(|e| ServerError::Usage(Usage::MetricsNotTcp { name: METRICS_NAME, source: e }))?);
    }
    Ok((metrics, rest))
}

/// Takes the `data` and `control` sockets out of `passed` (socket activation) or binds
/// them in the socket directory. Returns them and the remaining passed fds (the fd store's).
pub fn listeners(config: &Config, passed: Vec<ListenFd>) -> Result<(Listener, Listener, Vec<ListenFd>), ServerError> {
    let (mut data, mut control, mut rest) = (None, None, Vec::new());
    for p in passed {
        match p.name.as_str() {
            DATA_NAME if data.is_none() => data = Some(adopt(DATA_NAME, p.fd)?),
            CONTROL_NAME if control.is_none() => control = Some(adopt(CONTROL_NAME, p.fd)?),
            DATA_NAME | CONTROL_NAME => {
                return Err(ServerError::Usage(Usage::PassedTwice(p.name)));
            }
            _ if check_listening_unix_stream(p.fd.as_fd()).is_ok() => tracing::warn!(
                name = %p.name,
                path = %socket_path(p.fd.as_fd()),
                "a listening socket was passed without FileDescriptorName=data or control; closed"
            ),
            _ => rest.push(p),
        }
    }
    let data = match data {
        Some(l) => l,
        None => bind_own(config, config.data_socket())?,
    };
    let control = match control {
        Some(l) => l,
        None => bind_own(config, config.control_socket())?,
    };
    let activated = data.owned_path.is_none();
    if let Some(warning) = reach_warning(Path::new(&data.path), config.socket_group_name.as_deref(), activated) {
        tracing::warn!(socket = %data.path, "{warning}");
    }
    Ok((data, control, rest))
}
