//! Thin blocking client for **packd**, the host-wide packer of model weights.
//!
//! packd packs each weight once per host into a sealed memfd and passes the fd over a Unix
//! socket; this crate receives it, checks the seals, maps it read-only and gives typed
//! access to each packed tensor. Every process that maps the same model shares one copy.
//!
//! ```no_run
//! use packd_client::{Client, Plan};
//!
//! # fn main() -> Result<(), packd_client::Error> {
//! let client = Client::connect("/run/packd")?;
//! let model = client.pack("model.safetensors", &Plan::default())?;
//! let q = model.tensor("encoder.layer.0.attention.self.query.weight").expect("tensor");
//! println!("{} {} {:?}: {} bytes", q.name(), q.layout(), q.shape(), q.bytes().len());
//! model.verify()?; // BLAKE3 of every entry matches the daemon's table
//! # Ok(()) }
//! ```
//!
//! When the daemon restarts (an upgrade, a crash), mapped models keep working; calls fail
//! at once with [`Error::Unavailable`] while it is away, and the next call (or
//! [`Client::reconnect_if_lost`]) reconnects with bounded backoff and leases every model
//! this client still holds again.
//!
//! The library is blocking and pulls in neither tokio nor tonic (`packctl` is a crate of its
//! own).
#![warn(missing_docs)]

mod client;
mod conn;
mod error;
mod model;
pub mod names;
mod publish;
pub mod report;
pub mod sys;
mod timeouts;
mod wire;

pub use client::{Client, Plan, default_socket_dir, open_source};
pub use conn::{BACKOFF_MAX, BACKOFF_MIN};
pub use error::{Error, Lost, ProtocolError, connect_hint};
pub use model::{Model, Segment, Tensor};
pub use publish::{AcquireOptions, Acquired, FileDigest, PublishEntry};
pub use report::{Fallback, Obtained, Report, report_later};
pub use timeouts::{Call, Deadline, Timeouts};

pub use packd_proto::v1 as proto;

pub use packd_proto::{CONTROL_SOCKET, DATA_SOCKET};
