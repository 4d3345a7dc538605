//! What can be wrong with a source.

/// Errors about a source.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The fd is not something packd reads models from.
    #[error("source fd is {0}, not a regular file")]
    NotAFile(&'static str),
    /// The fd cannot be read.
    #[error("source fd is not readable: {0}")]
    Unreadable(std::io::Error),
    /// The bytes are not a valid safetensors file.
    #[error("{0}")]
    Format(String),
    /// The file changed while the daemon read it.
    #[error("source changed while it was read ({0}); pack it again once it is stable")]
    Changed(String),
    /// Nobody waits for the result any more (every requester left), or the source stopped
    /// answering and its watcher gave up.
    #[error("reading the source was stopped: {0}")]
    Stopped(&'static str),
}
