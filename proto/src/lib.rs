//! Wire messages of packd.
//!
//! * [`v1`] holds the data-plane frames (`Request`, `Reply`, …) exchanged on `packd.sock`
//!   and, with the `grpc` feature, the `packd.v1.Control` service stubs.
//! * [`FILE_DESCRIPTOR_SET`] (with `grpc`) feeds gRPC server reflection.
//!
//! * [`frame`] is the data-plane framing (length prefix, request and reply encodings, the
//!   frame reader), the one implementation both ends and the tests use.
//! * [`stream`] reads and writes whole frames on a blocking socket, within a deadline.
//! * [`sys`] passes fds over Unix sockets with SCM_RIGHTS, for both ends.
//! * [`units`] parses byte counts (`8GiB`) the same way in the daemon's config and the CLI.
//!
//! Only [`sys`] and [`stream`] make system calls; everything else here is plain data.

pub mod frame;
pub mod stream;
pub mod sys;
pub mod units;

/// Name of the data-plane socket inside the socket directory.
pub const DATA_SOCKET: &str = "packd.sock";
/// Name of the control-plane socket inside the socket directory.
pub const CONTROL_SOCKET: &str = "control.sock";
/// Full name of the control-plane gRPC service (also its `grpc.health.v1` service name).
pub const CONTROL_SERVICE: &str = "packd.v1.Control";
/// `FileDescriptorName=` of the data socket under socket activation (`LISTEN_FDNAMES`).
pub const DATA_FDNAME: &str = "data";
/// `FileDescriptorName=` of the control socket under socket activation.
pub const CONTROL_FDNAME: &str = "control";

/// Messages and (with the `grpc` feature) service stubs of package `packd.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1;

/// Encoded `FileDescriptorSet` of `packd.proto`, with comments, for server reflection.
#[cfg(feature = "grpc")]
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("packd_descriptor");
