//! The connection to the daemon: requests pipelined on one socket, each within a deadline,
//! and how the connection rides out a daemon restart.
//!
//! Locks, each held for one short step and never while waiting for the daemon:
//! * `link`: the stream, its epoch and the timeouts. Held to connect (bounded by the connect timeout) and
//!   to write one frame (bounded by the socket's send timeout). A release takes only this
//!   lock, for one small write: it never waits behind another caller's request.
//! * `inbox`: a slot per request in flight, the frame reader, and the requests given up on.
//!   A caller registers its slot before it sends, then waits on its own slot until its
//!   deadline. One caller at a time takes the reader out of the inbox and reads frames
//!   without holding any lock, filing each frame in the slot of its request and waking
//!   that caller only; a caller that leaves hands the reader on to one still waiting.
//!
//! Lock order: `link` may be held when taking `inbox`, never the other way round.
//!
//! A caller whose deadline passes gets [`Error::Timeout`] and abandons its request: when
//! the reply comes after all, it is dropped (and a segment's lease given back).
//!
//! When the daemon goes away, mappings keep working (they belong to this process) and the
//! connection is marked lost: requests fail at once with [`Error::Unavailable`]. The next
//! call reconnects — at most once per backoff interval, which doubles from
//! [`BACKOFF_MIN`] to [`BACKOFF_MAX`] while the daemon stays away — and re-establishes the
//! lease of every model this client still holds, by key, so the new daemon counts them.
//!
//! The parts, bottom up, none importing one above it. Each part with state says in a trait
//! what it asks of the connection that holds it, and [`Conn`] implements those traits:
//! * `lock`: taking a lock whatever a panic left behind;
//! * `leases`: the leases of held models, their registry, and a lease's release;
//! * `inbox`: the slots of requests in flight, the reader handed from caller to caller,
//!   and what becomes of each reply;
//! * `link`: connecting, the live stream and its epoch, `fork`, losing the connection,
//!   reconnecting within the backoff and leasing held models again;
//! * `reports`: the worker reports kept, sent, and flushed by a thread of their own;
//! * `calls`: [`Conn`], which ties them: requests, requests not answered, checks, timeouts.
//!
//! [`Error::Timeout`]: crate::Error::Timeout
//! [`Error::Unavailable`]: crate::Error::Unavailable

mod calls;
mod inbox;
mod leases;
mod link;
mod lock;
mod reports;

pub use link::{BACKOFF_MAX, BACKOFF_MIN};
pub use reports::MAX_REPORTS;

pub(crate) use calls::{Conn, Kind, Lease};
pub(crate) use inbox::{Answer, Answered};
pub(crate) use reports::remember_unsent;
