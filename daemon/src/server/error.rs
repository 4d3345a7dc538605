//! Why the daemon could not start or stopped serving.

use crate::control;

/// Why the daemon could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Something restarting cannot fix (a wrongly configured socket, socket activation
    /// that does not match the unit): the daemon exits with status 64, which the unit's
    /// `RestartPreventExitStatus=` honours.
    #[error("{0}")]
    Usage(String),
    /// A system call on the way up failed (`what` says which step).
    #[error("{what}: {source}")]
    Io {
        /// The step.
        what: String,
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
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let what = what.into();
        move |source| ServerError::Io { what, source }
    }
}
