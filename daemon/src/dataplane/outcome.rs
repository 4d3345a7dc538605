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
    },
    /// Send nothing (release).
    NoReply,
}
