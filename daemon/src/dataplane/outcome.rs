//! What a request is answered with.

use std::sync::Arc;

use packd_proto::v1::{self, ErrorCode};

use crate::store::Segment;

/// What to answer.
pub enum Outcome {
    /// Send this segment (and take a lease on it).
    Segment {
        /// The request's id.
        id: u64,
        /// The segment.
        seg: Arc<Segment>,
        /// Leave the entry table out: the client has it (it named this segment id and
        /// generation as known).
        omit_entries: bool,
        /// How a pack request got it (`Unspecified` for other requests).
        how: v1::PackOutcome,
    },
    /// Send an error.
    Error {
        /// The request's id.
        id: u64,
        /// The error code.
        code: ErrorCode,
        /// What went wrong.
        message: String,
    },
    /// Send a build role (an acquire found nothing published).
    Build {
        /// The request's id.
        id: u64,
        /// The role.
        reply: v1::BuildReply,
        /// The memfd lent to the builder (`reply.lent_bytes` long), sent with the reply.
        lent: Option<std::fs::File>,
    },
    /// Send a file's digest.
    Digest {
        /// The request's id.
        id: u64,
        /// The digest.
        reply: v1::FileDigestReply,
    },
    /// Send nothing (release).
    NoReply,
}

impl Outcome {
    /// How it ended, as the metrics name it: ok, build, private, none, or the error code
    /// in lowercase.
    pub fn code_name(&self) -> &'static str {
        match self {
            Self::Segment { .. } | Self::Digest { .. } => "ok",
            Self::NoReply => "none",
            Self::Build { reply, .. } if reply.role() == v1::build_reply::Role::Builder => "build",
            Self::Build { .. } => "private",
            Self::Error { code, .. } => match code {
                ErrorCode::Unspecified => "unspecified",
                ErrorCode::InvalidArgument => "invalid_argument",
                ErrorCode::NotFound => "not_found",
                ErrorCode::BadSource => "bad_source",
                ErrorCode::BadFd => "bad_fd",
                ErrorCode::FrameTooLarge => "frame_too_large",
                ErrorCode::MalformedFrame => "malformed_frame",
                ErrorCode::ResourceExhausted => "resource_exhausted",
                ErrorCode::Internal => "internal",
                ErrorCode::PermissionDenied => "permission_denied",
                ErrorCode::AlreadyExists => "already_exists",
            },
        }
    }
}
