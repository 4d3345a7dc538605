//! How long calls wait, and which call and deadline a timeout names.

use std::time::Duration;

/// How long client calls wait for the daemon. Every call has a deadline: a daemon that
/// accepts and never answers makes a call fail with [`Error::Timeout`] within `get`, never
/// hang. While a request runs, the daemon reports its progress at least once a second, so
/// a long pack is told apart from a daemon that stopped answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Connecting (and each reconnection), which waits only while the daemon's listen
    /// backlog is full. Default [`Timeouts::DEFAULT_CONNECT`].
    pub connect: Duration,
    /// The longest the daemon may stay silent on any request: a get of a key already
    /// packed is answered within it, a running pack reports progress within it. Also bounds
    /// each write on the socket (a release). Default [`Timeouts::DEFAULT_GET`].
    pub get: Duration,
    /// The longest a pack, an acquire, a publish, or a get that waits for a pack may take
    /// in all while the daemon reports progress. Default [`Timeouts::DEFAULT_PACK`].
    pub pack: Duration,
}

impl Timeouts {
    /// Connecting: a local daemon accepts in microseconds; 5 s is a daemon that is stuck.
    pub const DEFAULT_CONNECT: Duration = Duration::from_secs(5);
    /// Silence: the daemon answers from its index in microseconds and reports a running
    /// request's progress every second; 30 s rides out a loaded host and still unblocks a
    /// caller whose daemon stopped answering.
    pub const DEFAULT_GET: Duration = Duration::from_secs(30);
    /// A whole pack while it makes progress: a day, so that a pack of any size completes
    /// (a daemon that stops answering is caught by the silence deadline, not this).
    pub const DEFAULT_PACK: Duration = Duration::from_secs(24 * 3600);
}

impl Default for Timeouts {
    fn default() -> Self {
        Self { connect: Self::DEFAULT_CONNECT, get: Self::DEFAULT_GET, pack: Self::DEFAULT_PACK }
    }
}

/// What a call waited for when its deadline passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// Connecting.
    Connect,
    /// A get.
    Get,
    /// A pack.
    Pack,
    /// An acquire.
    Acquire,
    /// A publish.
    Publish,
    /// A digest request.
    Digest,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Call::Connect => "a connection",
            Call::Get => "a get request",
            Call::Pack => "a pack request",
            Call::Acquire => "an acquire request",
            Call::Publish => "a publish request",
            Call::Digest => "a digest request",
        })
    }
}

/// Which of a call's deadlines passed (see [`Timeouts`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deadline {
    /// The daemon stayed silent for `Timeouts::get` (or did not accept for `connect`).
    Silence,
    /// The whole request took longer than `Timeouts::pack`.
    Total,
    /// The daemon stopped reading requests: one could not be sent.
    Send,
}

impl std::fmt::Display for Deadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Deadline::Silence => "",
            Deadline::Total => " in all",
            Deadline::Send => " (it stopped reading requests)",
        })
    }
}
