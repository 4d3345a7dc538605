//! Thin, checked wrappers over the Linux system calls packd needs.
//!
//! With the SCM_RIGHTS helpers in `packd_proto::sys` (shared by both ends), this is the
//! only place in the daemon where `unsafe` lives. Every raw fd is wrapped in an
//! [`OwnedFd`](std::os::fd::OwnedFd) the moment it exists.

pub mod cpu;
pub mod memfd;
pub mod notify;
pub mod proc;
pub mod socket;
