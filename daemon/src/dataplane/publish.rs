//! Engine-published segments on the data plane: `acquire` (find, build or wait) and
//! `publish` (check a client's sealed memfd and its entry table, hash it, index it).
//!
//! Everything a publisher sends is checked before the daemon relies on it: the identity's
//! characters, the table (count, keys, alignment, bounds, overlaps) on the runtime (pure
//! arithmetic over at most `limits.max_publish_entries` entries), then on the blocking
//! pool the fd's seals and size and the BLAKE3 of every entry. A publication that fails any
//! check leaves nothing behind; the publisher's fd is closed.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::fcntl::SealFlag;
use packd_proto::v1::{self, ErrorCode, build_reply::Role};

use super::DataPlane;
use super::outcome::Outcome;
use crate::blocking::OpError;
use crate::service::{Stage, Track};
use crate::source::Progress;
use crate::store::{Acquired, BuildPhase, Peer, PublishRefused, Publisher, published_entry, published_source};

/// Longest cache identity, in bytes.
pub const MAX_IDENTITY: usize = 256;
/// Longest engine entry key, in bytes.
pub const MAX_ENTRY_KEY: usize = 512;
/// Alignment of every published entry's offset.
pub const PUBLISH_ALIGN: u64 = 64;

/// Why a publication (or an acquire's identity) was refused.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The identity is empty, too long, or not printable ASCII.
    #[error("identity must be 1 to {MAX_IDENTITY} printable ASCII characters (got {len} bytes{why})")]
    Identity {
        /// Its length in bytes.
        len: usize,
        /// What else is wrong.
        why: &'static str,
    },
    /// The table has no entries.
    #[error("the entry table is empty: publish at least one entry")]
    NoEntries,
    /// More aliases than [`MAX_ALIASES`], or one equal to the identity or repeated.
    #[error("aliases: at most {MAX_ALIASES}, each unlike the identity and the others (got {count})")]
    Aliases {
        /// Aliases sent.
        count: usize,
    },
    /// An alias that is not a valid identity.
    #[error("alias {index}: {source}")]
    Alias {
        /// Its position.
        index: usize,
        /// What is wrong with it.
        #[source]
        source: Box<PublishError>,
    },
    /// More entries than `limits.max_publish_entries`.
    #[error("{count} entries are more than limits.max_publish_entries ({max})")]
    TooManyEntries {
        /// Entries sent.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// An entry key that is empty, too long, or not printable ASCII.
    #[error("entry {index}: key must be 1 to {MAX_ENTRY_KEY} printable ASCII characters (got {len} bytes)")]
    EntryKey {
        /// Position in the table.
        index: usize,
        /// Length in bytes.
        len: usize,
    },
    /// Two entries with one key.
    #[error("entry key {0:?} appears twice")]
    DuplicateKey(String),
    /// An offset that is not a multiple of [`PUBLISH_ALIGN`].
    #[error("entry {key:?}: offset {offset} is not a multiple of {PUBLISH_ALIGN}")]
    Misaligned {
        /// The entry.
        key: String,
        /// Its offset.
        offset: u64,
    },
    /// An entry of length 0.
    #[error("entry {0:?} has length 0")]
    EmptyEntry(String),
    /// An entry that ends past the segment.
    #[error("entry {key:?}: [{offset}, {offset} + {length}) is not inside the segment of {size} bytes")]
    OutOfBounds {
        /// The entry.
        key: String,
        /// Its offset.
        offset: u64,
        /// Its length.
        length: u64,
        /// The declared size.
        size: u64,
    },
    /// Two entries whose bytes overlap.
    #[error("entries {0:?} and {1:?} overlap")]
    Overlap(String, String),
    /// The declared size is 0 or not a page multiple.
    #[error("size {size} is not a positive multiple of the page size {page}")]
    SizeNotPages {
        /// Declared size.
        size: u64,
        /// Page size.
        page: u64,
    },
    /// The declared size is over `limits.max_publish_bytes`.
    #[error("size {size} is over limits.max_publish_bytes ({max})")]
    TooLarge {
        /// Declared size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// The fd cannot carry seals: not a memfd (or not one created with MFD_ALLOW_SEALING).
    #[error("the fd is not a sealable memfd (F_GET_SEALS: {0}); create it with memfd_create(MFD_ALLOW_SEALING)")]
    NotMemfd(std::io::Error),
    /// Seals missing.
    #[error(
        "the memfd lacks the seals {0}: add F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_WRITE|F_SEAL_SEAL before publishing \
         (F_SEAL_WRITE fails while a writable shared mapping exists: unmap it, or remap it read-only, first)"
    )]
    Unsealed(String),
    /// Seals missing, and none can be added: `F_SEAL_SEAL` is set (as on a memfd made
    /// without `MFD_ALLOW_SEALING`).
    #[error(
        "the memfd lacks the seals {0} and can take no more (it carries F_SEAL_SEAL alone, as a memfd made \
         without MFD_ALLOW_SEALING does): create it with memfd_create(MFD_ALLOW_SEALING), write it, then add \
         F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_WRITE|F_SEAL_SEAL"
    )]
    Unsealable(String),
    /// Seals missing, and none can be added: `F_SEAL_SEAL` was added before them.
    #[error(
        "the memfd lacks the seals {0} and can take no more (F_SEAL_SEAL is set): make it again and add \
         F_SEAL_SEAL last, after F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_WRITE (F_SEAL_WRITE fails while a writable \
         shared mapping exists: unmap it, or remap it read-only, first)"
    )]
    SealedTooEarly(String),
    /// The memfd's size is not the declared one.
    #[error("the memfd is {actual} bytes, the request says {declared}")]
    SizeMismatch {
        /// Declared.
        declared: u64,
        /// fstat's.
        actual: u64,
    },
    /// The fd was sent open for writing only: packd cannot read (hash) it.
    #[error("the memfd was sent open write-only: send it readable (O_RDONLY or O_RDWR)")]
    WriteOnly,
    /// A publication with bytes outside its entries that are not zero could not be copied
    /// into a zero-padded memfd.
    #[error("copying the publication to zero the bytes outside its entries failed: {0}")]
    Copy(#[from] crate::sys::memfd::MemfdError),
    /// Reading the memfd failed.
    #[error("reading the published memfd failed: {0}")]
    Read(std::io::Error),
    /// The blocking pool could not run the check.
    #[error(transparent)]
    Op(#[from] OpError),
    /// The request stopped waiting (its source made no progress for the timeout) before
    /// the publication was indexed; it is not.
    #[error("the publication was given up before it was indexed (limits.source_timeout)")]
    Abandoned,
    /// Served to waiters, then hashing it failed: it was withdrawn from the index.
    #[error("hashing the publication failed after it was served: it is withdrawn (the daemon's log says why)")]
    HashFailed,
    /// The store refused it (already published, budget, quota).
    #[error(transparent)]
    Refused(#[from] PublishRefused),
}

impl PublishError {
    /// The wire error code.
    pub fn code(&self) -> ErrorCode {
        match self {
            PublishError::NotMemfd(_)
            | PublishError::Unsealed(_)
            | PublishError::Unsealable(_)
            | PublishError::SealedTooEarly(_)
            | PublishError::WriteOnly => ErrorCode::BadFd,
            PublishError::TooManyEntries { .. } | PublishError::TooLarge { .. } => ErrorCode::ResourceExhausted,
            PublishError::Refused(PublishRefused::Exists { .. }) => ErrorCode::AlreadyExists,
            PublishError::Refused(PublishRefused::Quota(_)) => ErrorCode::ResourceExhausted,
            PublishError::Op(OpError::PerUid { .. } | OpError::Busy(_)) => ErrorCode::ResourceExhausted,
            PublishError::Copy(_) => ErrorCode::ResourceExhausted,
            PublishError::Read(_) | PublishError::Op(_) | PublishError::Abandoned | PublishError::HashFailed => {
                ErrorCode::Internal
            }
            _ => ErrorCode::InvalidArgument,
        }
    }
}

fn printable(s: &str) -> bool {
    s.bytes().all(|b| (0x20..0x7f).contains(&b))
}

/// Most aliases a publication may file ([`check_aliases`]).
pub const MAX_ALIASES: usize = 4;

/// Checks a publication's aliases: at most [`MAX_ALIASES`], each a valid identity, none equal
/// to `identity` or to another.
pub fn check_aliases(identity: &str, aliases: &[String]) -> Result<(), PublishError> {
    let unique: std::collections::HashSet<&str> = aliases.iter().map(String::as_str).collect();
    if aliases.len() > MAX_ALIASES || unique.len() != aliases.len() || unique.contains(identity) {
        return Err(PublishError::Aliases { count: aliases.len() });
    }
    for (index, a) in aliases.iter().enumerate() {
        check_identity(a).map_err(|e| PublishError::Alias { index, source: Box::new(e) })?;
    }
    Ok(())
}

/// Checks a cache identity.
pub fn check_identity(identity: &str) -> Result<(), PublishError> {
    let len = identity.len();
    if len == 0 || len > MAX_IDENTITY {
        return Err(PublishError::Identity { len, why: "" });
    }
    if !printable(identity) {
        return Err(PublishError::Identity { len, why: ", not all printable ASCII" });
    }
    Ok(())
}

/// One checked table entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableEntry {
    /// The engine's key.
    pub key: String,
    /// Offset.
    pub offset: u64,
    /// Length.
    pub length: u64,
}

/// Checks a publication's declared size and table, and returns the table in offset order.
pub fn check_table(
    size: u64,
    entries: Vec<v1::PublishedEntry>,
    page: u64,
    max_bytes: u64,
    max_entries: usize,
) -> Result<Vec<TableEntry>, PublishError> {
    if size == 0 || !size.is_multiple_of(page.max(1)) {
        return Err(PublishError::SizeNotPages { size, page });
    }
    if size > max_bytes {
        return Err(PublishError::TooLarge { size, max: max_bytes });
    }
    if entries.is_empty() {
        return Err(PublishError::NoEntries);
    }
    if entries.len() > max_entries {
        return Err(PublishError::TooManyEntries { count: entries.len(), max: max_entries });
    }
    let mut table = Vec::with_capacity(entries.len());
    for (index, e) in entries.into_iter().enumerate() {
        let len = e.key.len();
        if len == 0 || len > MAX_ENTRY_KEY || !printable(&e.key) {
            return Err(PublishError::EntryKey { index, len });
        }
        if !e.offset.is_multiple_of(PUBLISH_ALIGN) {
            return Err(PublishError::Misaligned { key: e.key, offset: e.offset });
        }
        if e.length == 0 {
            return Err(PublishError::EmptyEntry(e.key));
        }
        if e.offset.checked_add(e.length).is_none_or(|end| end > size) {
            return Err(PublishError::OutOfBounds { key: e.key, offset: e.offset, length: e.length, size });
        }
        table.push(TableEntry { key: e.key, offset: e.offset, length: e.length });
    }
    let mut by_key: Vec<&TableEntry> = table.iter().collect();
    by_key.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    if let Some(w) = by_key.windows(2).find(|w| w[0].key == w[1].key) {
        return Err(PublishError::DuplicateKey(w[0].key.clone()));
    }
    table.sort_unstable_by_key(|e| e.offset);
    if let Some(w) = table.windows(2).find(|w| w[0].offset + w[0].length > w[1].offset) {
        return Err(PublishError::Overlap(w[0].key.clone(), w[1].key.clone()));
    }
    Ok(table)
}

/// Checks the fd's seals and size (system calls: run off the runtime).
fn check_fd(file: &File, declared: u64) -> Result<(), PublishError> {
    let seals = packd_proto::sys::seals(file.as_fd()).map_err(PublishError::NotMemfd)?;
    // The seals every served segment carries (clients check the same set).
    let missing = packd_proto::sys::required_seals() - seals;
    if !missing.is_empty() {
        let names = packd_proto::sys::seal_names(missing);
        return Err(if seals == SealFlag::F_SEAL_SEAL {
            PublishError::Unsealable(names)
        } else if seals.contains(SealFlag::F_SEAL_SEAL) {
            PublishError::SealedTooEarly(names)
        } else {
            PublishError::Unsealed(names)
        });
    }
    let mode = nix::fcntl::fcntl(file.as_fd(), nix::fcntl::FcntlArg::F_GETFL)
        .map(nix::fcntl::OFlag::from_bits_truncate)
        .map_err(|e| PublishError::Read(e.into()))?;
    if mode & nix::fcntl::OFlag::O_ACCMODE == nix::fcntl::OFlag::O_WRONLY {
        return Err(PublishError::WriteOnly);
    }
    let actual = file.metadata().map_err(PublishError::Read)?.len();
    if actual != declared {
        return Err(PublishError::SizeMismatch { declared, actual });
    }
    Ok(())
}

/// Bytes read per call while hashing.
const HASH_CHUNK: usize = 1 << 20;

/// Whether the bytes of a publication's mapping outside its entries are all zeros (the
/// table is in offset order).
fn gaps_zero_mapped(map: &[u8], table: &[TableEntry]) -> bool {
    let range = |from: u64, to: u64| {
        &map[usize::try_from(from).unwrap_or(usize::MAX)..usize::try_from(to).unwrap_or(usize::MAX)]
    };
    let mut end = 0;
    for e in table {
        if !range(end, e.offset).iter().all(|&b| b == 0) {
            return false;
        }
        end = e.offset + e.length;
    }
    range(end, map.len() as u64).iter().all(|&b| b == 0)
}

/// [`gaps_zero_mapped`] by reading the file (a memfd that could not be mapped).
fn gaps_zero_read(file: &File, size: u64, table: &[TableEntry], progress: &Progress) -> std::io::Result<bool> {
    let mut buf = vec![0u8; HASH_CHUNK.min(usize::try_from(size).unwrap_or(usize::MAX))];
    let mut end = 0;
    for e in table {
        if !zeros(file, end, e.offset, &mut buf, progress)? {
            return Ok(false);
        }
        end = e.offset + e.length;
    }
    zeros(file, end, size, &mut buf, progress)
}

/// Whether `[from, to)` of `file` is all zeros (it stops reading at the first byte that is
/// not).
fn zeros(file: &File, from: u64, to: u64, buf: &mut [u8], progress: &Progress) -> std::io::Result<bool> {
    let mut at = from;
    while at < to {
        let n = usize::try_from(to - at).unwrap_or(usize::MAX).min(buf.len());
        file.read_exact_at(&mut buf[..n], at)?;
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        progress.advance(n as u64);
        at += n as u64;
    }
    Ok(true)
}

/// A new sealed memfd of `size` bytes holding `file`'s entries and zeros elsewhere.
///
/// A publication is served as published, and after a restart as the cache directory keeps
/// it: entries and zeros between them. So that both are the same bytes, a publication
/// whose padding is not zero is served from this copy (its entries' digests are those
/// computed from the original, which is sealed and cannot change meanwhile).
fn zero_padded_copy(file: &File, size: u64, table: &[TableEntry], huge_pages: bool) -> Result<File, PublishError> {
    let copy = crate::sys::memfd::create("packd-published")?;
    {
        let mut map = crate::sys::memfd::FillMap::new(&copy, size, huge_pages)?;
        let bytes = map.bytes_mut();
        for e in table {
            // In bounds: check_table kept every entry inside `size`.
            let (from, to) = (usize::try_from(e.offset).unwrap_or(usize::MAX), usize::try_from(e.offset + e.length));
            let dst = to.ok().and_then(|to| bytes.get_mut(from..to)).ok_or(PublishError::OutOfBounds {
                key: e.key.clone(),
                offset: e.offset,
                length: e.length,
                size,
            })?;
            file.read_exact_at(dst, e.offset).map_err(PublishError::Read)?;
        }
    }
    crate::sys::memfd::seal(&copy)?;
    Ok(copy)
}

/// Handles an acquire: the published segment, the builder role, or (after waiting) either
/// of them or the advice to build privately. Memory this connection had lent to it and
/// nobody took is freed once it is served or told to build privately (while it waits, the
/// builder, another worker of the same uid, may take it).
pub async fn acquire(
    plane: &Arc<DataPlane>,
    client: u64,
    uid: u32,
    id: u64,
    a: v1::AcquireRequest,
    track: &Track,
) -> Outcome {
    let outcome = acquire_role(plane, client, uid, id, a, track).await;
    let builds = matches!(&outcome, Outcome::Build { reply, .. } if reply.role() == Role::Builder);
    if !builds && let Some(lend) = plane.packer.lends.unpark_of(client) {
        plane.packer.source_ops.dispose(uid, lend);
    }
    outcome
}

async fn acquire_role(
    plane: &Arc<DataPlane>,
    client: u64,
    uid: u32,
    id: u64,
    a: v1::AcquireRequest,
    track: &Track,
) -> Outcome {
    if let Err(e) = check_identity(&a.identity) {
        return Outcome::Error { id, code: e.code(), message: e.to_string() };
    }
    let limits = &plane.limits;
    let capped = |asked: u32, max: Duration| {
        if asked == 0 { max } else { Duration::from_secs(u64::from(asked)).min(max) }
    };
    let build_for = capped(a.build_seconds, limits.build_timeout);
    let wait_for = capped(a.wait_seconds, limits.build_wait);
    let wait_end = Instant::now() + wait_for;
    let private = |fallback: v1::Fallback, reason: String| Outcome::Build {
        id,
        reply: v1::BuildReply { role: Role::Private as i32, reason, fallback: fallback as i32, ..Default::default() },
        lent: None,
    };
    loop {
        match plane.store.acquire(client, uid, &a.identity, &plane.trusted_publishers, build_for, a.build_bytes) {
            // Asked for verified entries: a publication served before packd hashed it is
            // answered once hashed (or, withdrawn, the identity is asked for again).
            Acquired::Ready(seg) if a.verified && seg.pending => {
                if Instant::now() >= wait_end {
                    return private(
                        v1::Fallback::BuildTimeout,
                        "the publication's digests were not known within the wait asked for (verified entries)".into(),
                    );
                }
                track.stage(Stage::Waiting);
                plane.store.until_hashed(&seg, wait_end).await;
            }
            Acquired::Ready(seg) => {
                return Outcome::Segment { id, seg, omit_entries: false, how: v1::PackOutcome::Unspecified };
            }
            Acquired::Build { deadline } => {
                let (lent, dropped) = plane.packer.lends.take(&plane.store, client, uid, a.build_bytes, deadline).await;
                if let Some(dropped) = dropped {
                    plane.packer.source_ops.dispose(uid, dropped);
                }
                let left = deadline.saturating_duration_since(Instant::now());
                return Outcome::Build {
                    id,
                    reply: v1::BuildReply {
                        role: Role::Builder as i32,
                        deadline_ms: u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
                        reason: "nothing published or being built for this identity: build it and publish it".into(),
                        max_bytes: limits.max_publish_bytes,
                        max_entries: u32::try_from(limits.max_publish_entries).unwrap_or(u32::MAX),
                        fallback: 0,
                        lent_bytes: lent.as_ref().map_or(0, |l| l.bytes),
                    },
                    lent: lent.map(|l| l.file),
                };
            }
            Acquired::Refused(refused) => return private(v1::Fallback::BuildLimit, refused.to_string()),
            Acquired::Wait(mut wait) => {
                track.following(Stage::Waiting, &wait.done, wait.total);
                let end = wait.deadline.min(wait_end);
                let ended = loop {
                    // Woken at the end of the build, and every SLOW_CHECK to compare what is
                    // left of it with building privately.
                    let until = tokio::time::Instant::from_std(end.min(Instant::now() + SLOW_CHECK));
                    let phase = wait.phase.wait_for(|p| !matches!(p, BuildPhase::Building));
                    let woke = tokio::time::timeout_at(until, phase).await.map(|r| r.map(|phase| phase.clone()));
                    match woke {
                        Ok(r) => break Ok(r),
                        Err(timeout) if Instant::now() >= end => break Err(timeout),
                        Err(_) => {
                            if let Some(o) = plane.store.build_outlook(&wait).filter(|o| o.slower_than_building()) {
                                plane.store.count_build_slow();
                                let done = wait.done.bytes();
                                return private(
                                    v1::Fallback::BuildSlow,
                                    format!(
                                        "the build waited for would take longer than building privately: {done} of {} \
                                         bytes written, about {:.0} ms left against {:.0} ms to build",
                                        wait.total.max(done),
                                        o.remaining * 1e3,
                                        o.own * 1e3
                                    ),
                                );
                            }
                        }
                    }
                };
                match ended {
                    // Published or abandoned (or the role vanished): ask again.
                    Ok(Ok(BuildPhase::Published | BuildPhase::Abandoned | BuildPhase::Building) | Err(_)) => {}
                    Ok(Ok(BuildPhase::Expired)) => {
                        return private(
                            v1::Fallback::BuildTimeout,
                            "the builder did not publish within its deadline (limits.build_timeout)".into(),
                        );
                    }
                    Ok(Ok(BuildPhase::GaveUp(why))) => {
                        return private(
                            v1::Fallback::BuilderGaveUp,
                            format!("the builder gave its role up with nothing to publish: {why}"),
                        );
                    }
                    Err(_) if Instant::now() >= wait.deadline => {
                        plane.store.expire_build(&wait);
                        return private(
                            v1::Fallback::BuildTimeout,
                            "the builder did not publish within its deadline (limits.build_timeout)".into(),
                        );
                    }
                    Err(_) => {
                        return private(
                            v1::Fallback::BuildTimeout,
                            format!(
                                "another process has been building this identity for longer than this request waits \
                             ({wait_for:?}, limits.build_wait)"
                            ),
                        );
                    }
                }
            }
        }
    }
}

/// Handles a give-up: ends this connection's builder role of the identity, if it holds it.
/// Not answered; a bad identity or a role not held is logged (rate-limited) and ignored.
pub fn give_up(plane: &DataPlane, client: u64, uid: u32, g: &v1::GiveUpRequest) {
    if check_identity(&g.identity).is_err() {
        plane.store.count_error();
        return;
    }
    let reason = crate::store::untrusted_text(&g.reason, MAX_GIVE_UP_REASON);
    let gave_up = plane.store.give_up_build(client, uid, &g.identity, &reason);
    if plane.request_log.allow() {
        tracing::info!(client, uid, identity = %g.identity, gave_up, reason = %reason, "builder gave up");
    }
}

/// How often a waiter compares what is left of the build with building privately.
const SLOW_CHECK: Duration = Duration::from_millis(50);

/// Handles a builder's progress: how far its build of an identity has come. Not answered;
/// a bad identity or a role not held is counted as a request error and ignored.
pub fn build_progress(plane: &DataPlane, client: u64, uid: u32, p: &v1::BuildProgress) {
    if check_identity(&p.identity).is_err()
        || !plane.store.build_progress(client, uid, &p.identity, p.bytes_done, p.bytes_total)
    {
        plane.store.count_error();
    }
}

/// How much of a give-up's reason is kept (it is told to waiters and logged).
pub(super) const MAX_GIVE_UP_REASON: usize = 256;

/// Handles a publish: checks, hashes and indexes the sealed memfd `fd`.
pub async fn publish(
    plane: &Arc<DataPlane>,
    peer: Peer,
    sock: BorrowedFd<'_>,
    id: u64,
    p: v1::PublishRequest,
    fd: OwnedFd,
    track: &Track,
) -> Outcome {
    match publish_checked(plane, peer, sock, p, fd, track).await {
        Ok(seg) => Outcome::Segment { id, seg, omit_entries: false, how: v1::PackOutcome::Unspecified },
        Err(e) => {
            if !matches!(e, PublishError::Refused(_)) {
                plane.store.count_publish_refused();
            }
            Outcome::Error { id, code: e.code(), message: e.to_string() }
        }
    }
}

async fn publish_checked(
    plane: &Arc<DataPlane>,
    peer: Peer,
    sock: BorrowedFd<'_>,
    p: v1::PublishRequest,
    fd: OwnedFd,
    track: &Track,
) -> Result<Arc<crate::store::Segment>, PublishError> {
    let limits = &plane.limits;
    let checked = check_identity(&p.identity).and_then(|()| check_aliases(&p.identity, &p.aliases)).and_then(|()| {
        check_table(p.size, p.entries, plane.packer.page_size, limits.max_publish_bytes, limits.max_publish_entries)
    });
    let aliases = p.aliases;
    let table = match checked {
        Ok(table) => table,
        Err(e) => {
            // Closed off the runtime: a close can wait on a FUSE server for ever.
            plane.packer.source_ops.dispose(peer.uid, fd);
            return Err(e);
        }
    };
    // Recorded with the segment: `trusted_publisher_gids` may name a supplementary group.
    let groups = crate::sys::socket::peer_groups(sock).unwrap_or_default();
    let publisher = Publisher { uid: peer.uid, gid: peer.gid, groups, identity: p.identity };
    let (store, packer) = (Arc::clone(&plane.store), Arc::clone(&plane.packer));
    let size = p.size;
    let huge_pages = plane.packer.huge_pages;
    let progress = Arc::new(Progress::default());
    let watched = Arc::clone(&progress);
    track.reading(Stage::Hashing, &progress, size);
    // A file refused below (not a sealed memfd: a FUSE file, say) is closed off the pool
    // too, and does not hold the uid's slot while its close waits.
    let file = plane.packer.source_ops.guard(peer.uid, File::from(fd));
    let (seg, zeroed) = plane
        .packer
        .source_ops
        .run(peer.uid, "a read of a published memfd", Some(watched), move || {
            check_fd(&file, size)?;
            let source = published_source(publisher.uid, &publisher.identity);
            let entries: Vec<_> =
                table.iter().map(|e| published_entry(&source, &e.key, e.offset, e.length, [0; 32])).collect();
            // Room first: an identity already published, or a size the budget or the quota
            // refuses, costs no read, hash or copy (a sparse memfd of max_publish_bytes
            // costs its sender nothing).
            // Memory the daemon lent for this build: the segment takes its room.
            let inode = crate::store::inode_of(&file);
            let mut lent = inode.and_then(|i| packer.lends.reservation_of(publisher.uid, i));
            let reserved = store.reserve_publication(publisher.uid, &publisher.identity, size, &entries, &mut lent);
            let uid = publisher.uid;
            if let Err(PublishRefused::Exists { .. }) = &reserved {
                // Published already (another copy of the model): the provisional names its
                // waiters wait on name that segment.
                store.alias(uid, &publisher.identity, &aliases);
            }
            let put_back = |lent| {
                if let Some(i) = inode {
                    packer.lends.put_back(uid, i, lent);
                }
            };
            let ticket = reserved.inspect_err(|_| put_back(lent.take()))?;
            // Only the bytes between the entries are read now (a publication whose padding is
            // not zero is served from a zero-padded copy); the entries are hashed once it is
            // served, off the waiters' path.
            let padded = match crate::sys::memfd::map_sealed(&file, size) {
                Some(map) => gaps_zero_mapped(&map, &table),
                None => gaps_zero_read(&file, size, &table, &progress).map_err(PublishError::Read)?,
            };
            let file = if padded { file.into_inner() } else { zero_padded_copy(&file, size, &table, huge_pages)? };
            // A publication its request gave up on (no progress for limits.source_timeout)
            // is not indexed: its client was told it failed.
            if progress.stopped() {
                return Err(PublishError::Abandoned);
            }
            let identity = publisher.identity.clone();
            let seg = store.publish(ticket, publisher, file, size, entries, true)?;
            // Waiters on a provisional name are served with the identity's own.
            store.alias(uid, &identity, &aliases);
            // Returned only when the segment is that memfd (not a zero-padded copy, which
            // leaves the builder's pages where they were).
            if let Some(i) = inode.filter(|_| padded) {
                packer.lends.published(uid, i);
            }
            Ok::<_, PublishError>((seg, !padded))
        })
        .await??;
    // Waiters were served at once; the publisher's own reply comes with the digests (its
    // publication is in the index meanwhile, and its builder role ended).
    let hashing = Arc::new(Progress::default());
    track.following(Stage::Hashing, &hashing, seg.entries.iter().map(|e| e.length).sum());
    let seg = super::hasher::hash_later(&plane.store, &seg, hashing).await.map_err(|_| PublishError::HashFailed)?;
    if zeroed && plane.request_log.allow() {
        tracing::info!(uid = peer.uid, key = %seg.key, "a publication's bytes outside its entries were not zero: serving a zero-padded copy");
    }
    Ok(seg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(key: &str, offset: u64, length: u64) -> v1::PublishedEntry {
        v1::PublishedEntry { key: key.into(), offset, length }
    }

    #[test]
    fn a_good_table_comes_back_in_offset_order() {
        let t = check_table(8192, vec![e("b", 4096, 10), e("a", 0, 4096)], 4096, 1 << 20, 10).unwrap();
        assert_eq!(t.iter().map(|t| t.key.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    }

    #[test]
    fn every_bad_table_is_refused_with_its_reason() {
        let ok = || vec![e("a", 0, 64)];
        let cases: Vec<(u64, Vec<v1::PublishedEntry>, &str)> = vec![
            (0, ok(), "positive multiple of the page size"),
            (100, ok(), "positive multiple of the page size"),
            (1 << 30, ok(), "limits.max_publish_bytes"),
            (4096, vec![], "empty"),
            (4096, (0..11).map(|i| e(&format!("k{i}"), i * 64, 64)).collect(), "limits.max_publish_entries"),
            (4096, vec![e("", 0, 64)], "printable ASCII"),
            (4096, vec![e("a\nb", 0, 64)], "printable ASCII"),
            (4096, vec![e(&"x".repeat(513), 0, 64)], "printable ASCII"),
            (4096, vec![e("a", 0, 64), e("a", 64, 64)], "appears twice"),
            (4096, vec![e("a", 32, 64)], "not a multiple of 64"),
            (4096, vec![e("a", 0, 0)], "length 0"),
            (4096, vec![e("a", 4032, 65)], "not inside the segment"),
            (4096, vec![e("a", u64::MAX - 63, 64)], "not inside the segment"),
            (4096, vec![e("a", 0, 128), e("b", 64, 64)], "overlap"),
        ];
        for (size, table, want) in cases {
            let err = check_table(size, table.clone(), 4096, 1 << 20, 10).unwrap_err();
            assert!(err.to_string().contains(want), "{size} {table:?}: {err}");
        }
    }

    /// A sealed memfd of `size` bytes: `fill` at each entry, `pad` in the gaps.
    fn sealed(size: u64, table: &[TableEntry], pad: u8) -> File {
        let f = crate::sys::memfd::create("packd-test-publication").unwrap();
        let at = |v: u64| usize::try_from(v).unwrap();
        let mut bytes = vec![pad; at(size)];
        for (i, e) in table.iter().enumerate() {
            for (j, b) in bytes[at(e.offset)..at(e.offset + e.length)].iter_mut().enumerate() {
                *b = u8::try_from((i * 31 + j * 7) % 256).unwrap();
            }
        }
        f.write_all_at(&bytes, 0).unwrap();
        crate::sys::memfd::seal(&f).unwrap();
        f
    }

    #[test]
    fn hashing_from_the_mapping_gives_what_reading_gives() {
        let t = |key: &str, offset, length| TableEntry { key: key.into(), offset, length };
        let table = [t("a", 0, 3_000_000), t("b", 3_000_064, 64), t("c", 5_000_000, 1_000_000)];
        let size = 8 << 20;
        let source = crate::source::Digest([7; 32]);
        for pad in [0u8, 1] {
            let f = sealed(size, &table, pad);
            let entries = || -> Vec<_> {
                table.iter().map(|e| published_entry(&source, &e.key, e.offset, e.length, [0; 32])).collect()
            };
            let map = crate::sys::memfd::map_sealed(&f, size).expect("a sealed memfd maps");
            let padded = gaps_zero_mapped(&map, &table);
            let padded_read = gaps_zero_read(&f, size, &table, &Progress::default()).unwrap();
            assert_eq!((padded, padded_read), (pad == 0, pad == 0));
            let p = Progress::default();
            let mapped = super::super::hasher::digests_mapped(&map, &entries(), &p);
            assert_eq!(p.bytes(), 4_000_064, "every entry's bytes counted");
            assert_eq!(mapped, super::super::hasher::digests_read(&f, size, &entries(), &p).unwrap());
            assert_eq!(mapped, super::super::hasher::entry_digests(&f, size, &entries(), &p).unwrap());
            let mut all = vec![0u8; usize::try_from(size).unwrap()];
            f.read_exact_at(&mut all, 0).unwrap();
            assert_eq!(mapped[2], *blake3::hash(&all[5_000_000..6_000_000]).as_bytes());
        }
        // Not sealed: not mapped.
        let open = crate::sys::memfd::create("packd-test-open").unwrap();
        open.set_len(4096).unwrap();
        assert!(crate::sys::memfd::map_sealed(&open, 4096).is_none());
    }

    #[test]
    fn identities_are_bounded_printable_ascii() {
        assert!(check_identity("xnnpack:model=b3:abc;build=1").is_ok());
        for bad in ["", "a\u{7f}", "é", &"x".repeat(257)] {
            assert!(check_identity(bad).is_err(), "{bad:?}");
        }
    }
}
