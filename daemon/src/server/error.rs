//! Why the daemon could not start or stopped serving.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::control;
use crate::persist::lock::InUse;
use crate::sys::notify::PassedSocketError;

/// Why the daemon could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Something restarting cannot fix (a wrongly configured socket, socket activation
    /// that does not match the unit): the daemon exits with status 64, which the unit's
    /// `RestartPreventExitStatus=` honours.
    #[error(transparent)]
    Usage(Usage),
    /// A system call on the way up failed (`what` says which step).
    #[error("{what}: {source}")]
    Io {
        /// The step.
        what: Step,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Persisted state could not be adopted or followed.
    #[error(transparent)]
    Persist(#[from] crate::persist::StartError),
    /// The control plane could not be set up or failed.
    #[error(transparent)]
    Control(#[from] control::ControlError),
}

/// `e` and its sources, joined by ": " (as a log line).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let more = cause.to_string();
        if !text.ends_with(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        next = cause.source();
    }
    text
}

impl ServerError {
    /// Whether restarting cannot help (exit status 64).
    pub fn is_usage(&self) -> bool {
        matches!(self, ServerError::Usage(_))
    }

    /// An I/O error of the step `what`.
    pub fn io(what: Step) -> impl FnOnce(std::io::Error) -> Self {
        move |source| ServerError::Io { what, source }
    }
}

/// Something restarting cannot fix.
#[derive(Debug, thiserror::Error)]
pub enum Usage {
    #[error(
        "{} is served by another running daemon: each daemon needs a socket_dir of its own (stop the other one, \
         or give this one another --socket-dir)",
        .0.display()
    )]
    SocketServed(PathBuf),
    #[error(
        "the socket passed as {name:?} (LISTEN_FDNAMES) is {why}; packd.socket must use ListenStream=/path with \
         FileDescriptorName={name}"
    )]
    PassedNotUnixStream { name: &'static str, why: PassedSocketError },
    /// The name passed twice.
    #[error("more than one socket passed as {0:?} (LISTEN_FDNAMES)")]
    PassedTwice(String),
    #[error(
        "the socket passed as {name:?} is not a listening TCP socket ({source}); packd-metrics.socket must use \
         ListenStream=ADDRESS:PORT"
    )]
    MetricsNotTcp { name: &'static str, source: std::io::Error },
    #[error("socket activation: {0}")]
    Activation(std::io::Error),
    #[error("locking the cache directory: {0}")]
    LockThread(tokio::task::JoinError),
    #[error(transparent)]
    CacheDirInUse(InUse),
}

/// A step on the way up.
#[derive(Debug, thiserror::Error)]
pub enum Step {
    #[error("handling {0}")]
    Signal(&'static str),
    #[error("connecting to NOTIFY_SOCKET")]
    NotifySocket,
    #[error("removing stale socket {}", .0.display())]
    RemoveStale(PathBuf),
    #[error("binding {}", .0.display())]
    Bind(PathBuf),
    #[error("chgrp {gid} {} (socket_group)", .path.display())]
    Chgrp { gid: u32, path: PathBuf },
    #[error("chmod {mode:o} {}", .path.display())]
    Chmod { mode: u32, path: PathBuf },
    #[error("the socket passed as {0:?}")]
    Passed(&'static str),
    #[error("creating socket directory {}", .0.display())]
    SocketDir(PathBuf),
    #[error("binding the control plane to {0}")]
    BindControl(SocketAddr),
    #[error("binding the metrics listener to {0}")]
    BindMetrics(SocketAddr),
}
