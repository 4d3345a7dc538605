//! Wire messages of packd.
//!
//! * [`v1`] holds the data-plane frames (`Request`, `Reply`, …) exchanged on `packd.sock`
//!   and, with the `grpc` feature, the `packd.v1.Control` service stubs.
//! * [`FILE_DESCRIPTOR_SET`] (with `grpc`) feeds gRPC server reflection.
//!
//! * [`sys`] passes fds over Unix sockets with SCM_RIGHTS, for both ends.
//!
//! Only [`sys`] makes system calls; everything else here is plain data.

pub mod sys;

/// Messages and (with the `grpc` feature) service stubs of package `packd.v1`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/packd.v1.rs"));
}

/// Encoded `FileDescriptorSet` of `packd.proto`, with comments, for server reflection.
#[cfg(feature = "grpc")]
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("packd_descriptor");
