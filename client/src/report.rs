//! Telling packd how this worker obtained each model's weights, so that a private fallback
//! anywhere on the host shows in `packctl stats`, `packctl top` and the metrics.
//!
//! A report is one write on the connection the client holds, never waited for. The client
//! keeps its latest report per engine and model (at most [`MAX_REPORTS`]) and sends them
//! again on every new connection (after a daemon restart, or once a daemon that was away
//! can be reached). The daemon attributes reports to the connection's pid and uid and only
//! counts and shows them.

use crate::client::Client;
use crate::proto;

pub use crate::proto::Fallback;

pub use crate::conn::MAX_REPORTS;

/// How a worker obtained a model's weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Obtained {
    /// It maps a segment packd serves.
    Served,
    /// It built them and published them.
    Built,
    /// It holds them privately, for this reason.
    Private(Fallback),
}

/// One report about one model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The engine or integration ("xnnpack", "llama.cpp", ...).
    pub engine: String,
    /// The model: its cache identity or segment key when there is one, else a name.
    pub model: String,
    /// How its weights were obtained.
    pub obtained: Obtained,
    /// The engine's own words (e.g. the daemon's refusal).
    pub detail: String,
    /// Bytes of packed weights held privately.
    pub private_bytes: u64,
    /// Bytes mapped from packd.
    pub shared_bytes: u64,
}

impl Report {
    /// A report that `model`'s weights are held privately, `bytes` of them, because of
    /// `fallback` (`detail`: in the engine's words).
    pub fn private(engine: &str, model: &str, fallback: Fallback, detail: &str, bytes: u64) -> Self {
        Self {
            engine: engine.to_string(),
            model: model.to_string(),
            obtained: Obtained::Private(fallback),
            detail: detail.to_string(),
            private_bytes: bytes,
            shared_bytes: 0,
        }
    }

    /// A report that `model` is mapped from packd (`bytes` of it).
    pub fn served(engine: &str, model: &str, bytes: u64) -> Self {
        Self {
            engine: engine.to_string(),
            model: model.to_string(),
            obtained: Obtained::Served,
            detail: String::new(),
            private_bytes: 0,
            shared_bytes: bytes,
        }
    }

    /// A report that this worker built `model` and published it (`bytes` of it).
    pub fn built(engine: &str, model: &str, bytes: u64) -> Self {
        Self { obtained: Obtained::Built, ..Self::served(engine, model, bytes) }
    }

    pub(crate) fn to_proto(&self) -> proto::WorkerReport {
        let (obtained, fallback) = match self.obtained {
            Obtained::Served => (proto::Obtained::Served, Fallback::Unspecified),
            Obtained::Built => (proto::Obtained::Built, Fallback::Unspecified),
            Obtained::Private(f) => (proto::Obtained::Private, f),
        };
        proto::WorkerReport {
            engine: self.engine.clone(),
            model: self.model.clone(),
            obtained: obtained as i32,
            fallback: fallback as i32,
            detail: self.detail.clone(),
            private_bytes: self.private_bytes,
            shared_bytes: self.shared_bytes,
        }
    }
}

/// The stable lowercase name of a reason, as the daemon's stats and metrics show it
/// ("daemon_away", "build_timeout", ...).
pub fn fallback_name(f: Fallback) -> String {
    match f {
        Fallback::Unspecified | Fallback::Other => "other".into(),
        f => f.as_str_name().to_ascii_lowercase(),
    }
}

/// Keeps a report made while packd cannot be reached (no [`Client`] could connect): the
/// next connection a client of this process makes sends it. Returns false when it was not
/// kept: [`MAX_REPORTS`] reports of other engines and models wait already. A client that is
/// connected sends only its own reports ([`Client::report`]): use it when you have one.
pub fn report_later(report: &Report) -> bool {
    crate::conn::remember_unsent(report.to_proto())
}

impl Client {
    /// Tells packd how this worker obtained a model's weights (see [`Report`]). Not
    /// answered, and never waits: a report that cannot be written at once (a burst filled
    /// the socket) is sent by the next call or report. The client keeps its latest report
    /// per engine and model (at most [`MAX_REPORTS`]; one of a new pair past them is sent
    /// once, not kept) and sends them again on every new connection.
    pub fn report(&self, report: &Report) {
        self.conn.report(report.to_proto());
    }
}

impl crate::error::Error {
    /// The reason to report when this error leaves a model's weights private: packd
    /// unreachable (`DaemonAway`), a quota or limit (`OverQuota`), a refused request of an
    /// engine's publication (`PublishRefused`), anything else (`WorkerError`).
    pub fn fallback(&self) -> Fallback {
        use crate::proto::ErrorCode;
        match self {
            Self::Connect { .. } | Self::Unavailable { .. } | Self::Disconnected => Fallback::DaemonAway,
            Self::Daemon { code: ErrorCode::ResourceExhausted, .. } => Fallback::OverQuota,
            Self::Daemon { code: ErrorCode::AlreadyExists | ErrorCode::InvalidArgument | ErrorCode::BadFd, .. } => {
                Fallback::PublishRefused
            }
            _ => Fallback::WorkerError,
        }
    }
}
