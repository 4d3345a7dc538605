//! Engine-published segments: acquire the segment an engine published for a cache
//! identity (or the role of building it), and publish one this process built.
//!
//! The protocol (docs/PROTOCOL.md, "acquire and publish — engine-published segments"): `acquire(identity)`
//! answers with the published segment, or makes this connection the identity's builder
//! until a deadline, or (after waiting for another process's build) says to build
//! privately. The builder fills a memfd of its own, seals it with the full seal set (no
//! writable shared mapping may remain), and `publish`es it with its entry table. The
//! daemon checks and hashes it and serves it to every later `acquire` of the namespace.

use std::fs::File;
use std::sync::Arc;
use std::time::Duration;

use crate::client::Client;
use crate::conn::{Answer, Answered, Kind};
use crate::error::Error;
use crate::model::Segment;
use crate::proto::{self, build_reply::Role, request};

/// One entry of a segment to publish, as the engine names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublishEntry {
    /// The engine's key: 1 to 512 printable ASCII characters, unique in the table.
    pub key: String,
    /// Offset in the segment: a multiple of 64.
    pub offset: u64,
    /// Length in bytes: more than 0; the entry must end inside the segment.
    pub length: u64,
}

/// What an acquire got.
pub enum Acquired {
    /// The published segment (leased; map it with [`Segment::map`]). A waiter may be served
    /// it before packd has hashed it: then `info().digests_pending` is true, the entries'
    /// digests are empty and `verify` says `DIGESTS_PENDING` (acquire again later to verify).
    Segment(Segment),
    /// This connection builds: publish within `deadline` (then the role ends). It also
    /// ends when this client's connection closes.
    Build {
        /// Time left to publish.
        deadline: Duration,
        /// The largest segment the daemon accepts (limits.max_publish_bytes).
        max_bytes: u64,
        /// The most entries it accepts (limits.max_publish_entries).
        max_entries: u32,
        /// Memory the daemon allocated for this build while it hashed the model
        /// ([`Client::file_digest_for_build`]): a read-write memfd of the asked
        /// `build_bytes` (page-rounded), its pages allocated, sealing allowed. Build into it,
        /// then seal and publish it as [`Client::publish`] says. Its bytes count against
        /// this uid (limits.max_lent_bytes_per_uid, and 16 lends) and in the daemon's budget
        /// from its allocation until it is published as it is; never published (given up,
        /// say), it stays counted until the daemon restarts (docs/PROTOCOL.md, "Memory lent
        /// for a build"). `None` when nothing was lent: not asked for, more than the file
        /// can need, no room, more than the host can spare, taken back for another's
        /// room or unclaimed in time.
        memory: Option<File>,
    },
    /// Build privately and do not publish.
    Private {
        /// Why, as a worker reports it: the wait or the builder's deadline ran out
        /// (`BuildTimeout`), the builder gave up (`BuilderGaveUp`), a limit on builder
        /// roles (`BuildLimit`), or what was left of the build would take longer than
        /// building privately (`BuildSlow`, with [`AcquireOptions::build_bytes`]).
        fallback: crate::report::Fallback,
        /// Why, in the daemon's words.
        reason: String,
    },
}

/// How long an acquire may wait and a build may take (0: the daemon's defaults,
/// limits.build_wait and limits.build_timeout; more is capped at them), and what a build
/// writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AcquireOptions {
    /// Seconds this process asks for, should it become the builder.
    pub build_seconds: u32,
    /// Seconds to wait at most for another process's build.
    pub wait_seconds: u32,
    /// Bytes the build writes, when known (0: not known). With it (and the builder's
    /// [`Client::build_progress`]), a process waiting for the build is told to build
    /// privately (`BuildSlow`) once the build left would take longer than that.
    pub build_bytes: u64,
    /// Serve only a segment whose entries' digests are known (checked by
    /// [`crate::Model::verify`]): a publication served before packd hashed it is answered
    /// once hashed, within `wait_seconds`.
    pub verified: bool,
}

/// A whole file's BLAKE3, as the daemon computed it ([`Client::file_digest`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileDigest {
    /// The digest.
    pub blake3: [u8; 32],
    /// The file's size.
    pub size: u64,
    /// Whether this request hashed it (false: the daemon knew it, or another request's
    /// hash answered both).
    pub hashed: bool,
}

impl Client {
    /// Gets the segment published for cache `identity` (in this uid's namespace, or by a
    /// trusted publisher), or the role of building it, or waits for the process that
    /// builds it. See [`Acquired`].
    pub fn acquire(&self, identity: &str, options: AcquireOptions) -> Result<Acquired, Error> {
        let body = request::Body::Acquire(proto::AcquireRequest {
            identity: identity.to_string(),
            build_seconds: options.build_seconds,
            wait_seconds: options.wait_seconds,
            build_bytes: options.build_bytes,
            verified: options.verified,
        });
        match self.conn.call_any(body, None, Kind::Acquire, None)? {
            Answered::Segment(Answer { info, file, epoch }) => {
                let lease = self.conn.lease(&info, epoch);
                Ok(Acquired::Segment(self.finish(Arc::new(info), file, lease)?))
            }
            Answered::Digest(_) => Err(crate::error::ProtocolError::UnexpectedDigest.into()),
            Answered::Build(b, memory) => match b.role() {
                Role::Builder => Ok(Acquired::Build {
                    deadline: Duration::from_millis(b.deadline_ms),
                    max_bytes: b.max_bytes,
                    max_entries: b.max_entries,
                    memory,
                }),
                Role::Private => Ok(Acquired::Private {
                    fallback: match b.fallback() {
                        crate::report::Fallback::Unspecified => crate::report::Fallback::Other,
                        f => f,
                    },
                    reason: b.reason,
                }),
                Role::Unspecified => Err(crate::error::ProtocolError::NoRole.into()),
            },
        }
    }

    /// Tells the daemon how far this client's build of `identity` has come: `done` of
    /// `total` bytes (0: as the acquire said). Not answered, never waits; call it as the
    /// build goes (a few times a second at most is plenty).
    pub fn build_progress(&self, identity: &str, done: u64, total: u64) {
        let body = request::Body::BuildProgress(proto::BuildProgress {
            identity: identity.to_string(),
            bytes_done: done,
            bytes_total: total,
        });
        self.conn.notify(body, None);
    }

    /// The BLAKE3 of the whole of `file` (a model an engine maps), computed by the daemon
    /// once per host: remembered by the file's identity (device, inode, size, times), and
    /// processes asking at once share one hash.
    pub fn file_digest(&self, file: &File) -> Result<FileDigest, Error> {
        self.file_digest_for_build(file, 0)
    }

    /// [`Client::file_digest`] for a process that would build `build_bytes` of packed
    /// weights from `file` should it become a builder: when this request is the one that
    /// hashes the file (the first to ask), the daemon allocates a memfd of that size
    /// meanwhile, and the next [`Client::acquire`] of this uid that becomes the builder with
    /// the same [`AcquireOptions::build_bytes`] gets it (`Acquired::Build::memory`): this
    /// client's, or another worker's that started with it and acquired first. Only clients
    /// that called this with a non-zero `build_bytes` are lent memory, at most the file's
    /// size plus an eighth plus 1 MiB (a bigger ask is lent nothing; the digest is answered
    /// either way).
    pub fn file_digest_for_build(&self, file: &File, build_bytes: u64) -> Result<FileDigest, Error> {
        self.digest(file, build_bytes, false)
    }

    /// [`Client::file_digest`] wanted beside a build already under way (started under a
    /// provisional name): a hash the daemon starts for it runs on one core fewer than the
    /// host has, leaving the build a core. Ask it on a connection other than the builder's:
    /// packd answers a connection's requests in turn, so on the builder's the hash would
    /// hold back its progress reports and a give-up.
    pub fn file_digest_beside_build(&self, file: &File) -> Result<FileDigest, Error> {
        self.digest(file, 0, true)
    }

    fn digest(&self, file: &File, build_bytes: u64, background: bool) -> Result<FileDigest, Error> {
        let body = request::Body::Digest(proto::FileDigestRequest { build_bytes, background });
        match self.conn.call_any(body, Some(file), Kind::Digest, None)? {
            Answered::Digest(d) => {
                let blake3 = <[u8; 32]>::try_from(d.blake3.as_slice())
                    .map_err(|_| Error::Protocol(crate::error::ProtocolError::UnexpectedDigest))?;
                Ok(FileDigest { blake3, size: d.size, hashed: d.hashed })
            }
            Answered::Segment(_) | Answered::Build(..) => Err(crate::error::ProtocolError::UnexpectedDigest.into()),
        }
    }

    /// Gives up the builder role of `identity` that [`Client::acquire`] gave this client,
    /// publishing nothing: the processes waiting for it are told at once to build privately
    /// (with `reason`). Call it as soon as it is known that nothing will be published.
    /// Not answered; ignored by the daemon when the role is not held (it ended already).
    pub fn give_up(&self, identity: &str, reason: &str) {
        let body =
            request::Body::GiveUp(proto::GiveUpRequest { identity: identity.to_string(), reason: reason.to_string() });
        self.conn.notify(body, None);
    }

    /// Publishes `file` — a memfd of `size` bytes (a positive multiple of the page size),
    /// sent readable, that this process filled and sealed with F_SEAL_SEAL, F_SEAL_SHRINK,
    /// F_SEAL_GROW and F_SEAL_WRITE — as the cache of `identity`. Entries start at multiples
    /// of 64 and do not overlap; bytes outside them are served as zeros (keep them zero, and
    /// packd serves this very memfd; else it serves a zero-padded copy). Returns the indexed segment (leased; the same bytes), once packd has hashed it (its waiters are served before). Fails with the
    /// daemon's ALREADY_EXISTS when the identity is already published in this namespace.
    pub fn publish(&self, identity: &str, file: &File, size: u64, entries: &[PublishEntry]) -> Result<Segment, Error> {
        self.publish_aliased(identity, &[], file, size, entries)
    }

    /// [`Client::publish`], and files `aliases` (at most 4 other identities, such as the
    /// provisional name the build was started under before the model's digest was known) to
    /// the segment: the waiters of each alias's builder role are served it, and later
    /// acquires of an alias in this namespace find it while it stays in the daemon's index.
    /// When `identity` is published already, the aliases are filed to that segment and this
    /// fails with ALREADY_EXISTS (acquire an alias to be served it). packd cannot tell what
    /// a provisional name was made of: check that the source is unchanged before calling
    /// this, and [`Client::give_up`] the provisional role instead if it changed.
    pub fn publish_aliased(
        &self,
        identity: &str,
        aliases: &[String],
        file: &File,
        size: u64,
        entries: &[PublishEntry],
    ) -> Result<Segment, Error> {
        let body = request::Body::Publish(proto::PublishRequest {
            identity: identity.to_string(),
            aliases: aliases.to_vec(),
            size,
            entries: entries
                .iter()
                .map(|e| proto::PublishedEntry { key: e.key.clone(), offset: e.offset, length: e.length })
                .collect(),
        });
        let Answer { info, file, epoch } = self.conn.call(body, Some(file), Kind::Publish)?;
        let lease = self.conn.lease(&info, epoch);
        self.finish(Arc::new(info), file, lease)
    }
}
