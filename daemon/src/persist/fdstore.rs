//! systemd's fd store: every sealed segment is stored there under its name, beside a
//! sealed manifest memfd (`packd-manifest.<seq>`) recording each one's identity and
//! table. On start the stored fds come back (`LISTEN_FDS`); each is served again only if it
//! is the very sealed memfd the manifest names. Everything else is closed and removed from
//! the store (`FDSTOREREMOVE=1`), as logind does with fds that fail its checks.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;

use packd_proto::sys::{required_seals, seals};
use packd_proto::v1::{FdStoreManifest, StoredSegment};
use prost::Message;

use super::{PersistError, record};
use crate::service::Packer;
use crate::store::Adopted;
use crate::sys::memfd;
use crate::sys::notify::{self, ListenFd, Notifier};

/// Names of manifests start with this, followed by a sequence number.
pub const MANIFEST_PREFIX: &str = "packd-manifest.";
/// Manifests larger than this are not read: it records every stored segment's table (as
/// a cache file header does), and no store of systemd's holds more than a few thousand fds.
const MAX_MANIFEST: u64 = 256 << 20;

/// `FDSTORE=1` for one fd (`FDPOLL=0`: memfds are not pollable).
pub fn store(notifier: &Notifier, name: &str, file: &File) -> std::io::Result<()> {
    notifier.send_fds(&format!("FDSTORE=1\nFDNAME={name}\nFDPOLL=0"), &[file.as_fd()])
}

/// `FDSTOREREMOVE=1` for every fd stored as `name`.
pub fn remove(notifier: &Notifier, name: &str) {
    if let Err(e) = notifier.send(&format!("FDSTOREREMOVE=1\nFDNAME={name}")) {
        tracing::warn!(name, error = %e, "cannot remove an fd from the fd store");
    }
}

/// Writes `segments` into a new sealed manifest memfd and stores it as sequence `seq`.
pub fn write_manifest(notifier: &Notifier, seq: u64, segments: Vec<StoredSegment>) -> Result<(), PersistError> {
    let bytes = FdStoreManifest { format: record::FORMAT, segments }.encode_to_vec();
    let mut file = memfd::create("packd-manifest")?;
    file.write_all(&bytes).map_err(PersistError::io("writing the manifest"))?;
    memfd::seal(&file)?;
    store(notifier, &format!("{MANIFEST_PREFIX}{seq}"), &file).map_err(PersistError::io("storing the manifest"))
}

/// The whole of a sealed memfd of `size` bytes (at most [`MAX_MANIFEST`]).
fn read_all(file: &File, size: u64) -> Result<Vec<u8>, PersistError> {
    let len = usize::try_from(size).map_err(|_| PersistError::Implausible { what: "manifest", bytes: size })?;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, 0).map_err(PersistError::io("reading the manifest"))?;
    Ok(buf)
}

/// Why `file` is not a sealed memfd of `size` bytes (any size when `None`) at `dev`/`ino`.
fn check_sealed_memfd(file: &File, want: Option<(u64, u64, u64)>) -> Result<u64, PersistError> {
    let id = notify::identify(file.as_fd()).map_err(PersistError::io("cannot stat it"))?;
    if !id.memfd {
        return Err(PersistError::NotAMemfd);
    }
    let have = seals(file.as_fd()).map_err(PersistError::io("cannot read its seals"))?;
    if !have.contains(required_seals()) {
        return Err(PersistError::Unsealed(packd_proto::sys::seal_names(have)));
    }
    if let Some((dev, ino, size)) = want {
        if (id.dev, id.ino) != (dev, ino) {
            return Err(PersistError::OtherFile { ino: id.ino, dev: id.dev, want_ino: ino, want_dev: dev });
        }
        if id.size != size {
            return Err(PersistError::FdSize { found: id.size, expected: size });
        }
    }
    Ok(id.size)
}

/// What adopting the fd store found.
#[derive(Debug, Default)]
pub struct Adoption {
    /// Sequence number of the manifest in use (the next one is written as `seq + 1`).
    pub manifest_seq: u64,
    /// Segments served again.
    pub adopted: usize,
    /// Bytes of segments served again.
    pub bytes: u64,
    /// fds closed and removed from the store.
    pub refused: usize,
}

/// Adopts the fds the fd store gave back. Blocking (reads the manifest).
pub fn adopt(packer: &Packer, stored: Vec<ListenFd>, notifier: &Notifier) -> Adoption {
    let mut out = Adoption::default();
    if stored.is_empty() {
        return out;
    }
    let (manifests, others): (Vec<_>, Vec<_>) = stored.into_iter().partition(|f| f.name.starts_with(MANIFEST_PREFIX));
    let records = choose_manifest(manifests, notifier, &mut out);
    let (good, removed) = check_fds(packer, others, &records, notifier, &mut out);
    index(packer, good, &removed, notifier, &mut out);
    out
}

/// Reads the newest manifest that checks out and removes every other one from the store;
/// returns its records by fd name.
fn choose_manifest(
    mut manifests: Vec<ListenFd>,
    notifier: &Notifier,
    out: &mut Adoption,
) -> HashMap<String, StoredSegment> {
    let seq_of = |name: &str| name[MANIFEST_PREFIX.len()..].parse::<u64>();
    manifests.sort_by_key(|m| std::cmp::Reverse(seq_of(&m.name).unwrap_or(0)));
    let mut chosen: Option<FdStoreManifest> = None;
    for m in manifests {
        let file = File::from(m.fd);
        let parsed = chosen.is_none().then(|| {
            let size = check_sealed_memfd(&file, None)?;
            if size > MAX_MANIFEST {
                return Err(PersistError::Implausible { what: "manifest", bytes: size });
            }
            let seq = seq_of(&m.name).map_err(|_| PersistError::NoSequence)?;
            let manifest = FdStoreManifest::decode(read_all(&file, size)?.as_slice())
                .map_err(|source| PersistError::Decode { what: "manifest", source })?;
            if manifest.format != record::FORMAT {
                return Err(PersistError::Format { found: manifest.format, current: record::FORMAT });
            }
            Ok((seq, manifest))
        });
        match parsed {
            Some(Ok((seq, manifest))) => {
                out.manifest_seq = seq;
                chosen = Some(manifest);
                // Kept in the store until the next manifest replaces it.
            }
            Some(Err(why)) => {
                tracing::warn!(name = %m.name, why = %why, "fd store: manifest refused, closed and removed");
                remove(notifier, &m.name);
                out.refused += 1;
            }
            None => {
                tracing::info!(name = %m.name, "fd store: older manifest removed");
                remove(notifier, &m.name);
            }
        }
    }
    chosen.map(|m| m.segments.into_iter().map(|s| (s.fd_name.clone(), s)).collect()).unwrap_or_default()
}

/// Checks every stored segment fd against its record; closes and removes the bad ones.
/// Returns the good ones (name, segment) and the names removed from the store. Every fd
/// is checked before any is adopted: a bad fd stored under a good one's name takes that
/// name out of the store too, so the good one must be stored again.
fn check_fds(
    packer: &Packer,
    fds: Vec<ListenFd>,
    records: &HashMap<String, StoredSegment>,
    notifier: &Notifier,
    out: &mut Adoption,
) -> (Vec<(String, Adopted)>, HashSet<String>) {
    let mut good = Vec::new();
    let mut removed = HashSet::new();
    for f in fds {
        let file = File::from(f.fd);
        let checked = match records.get(&f.name) {
            None => Err(PersistError::Unnamed),
            Some(rec) => {
                let seg = rec.segment.clone().unwrap_or_default();
                check_sealed_memfd(&file, Some((rec.dev, rec.ino, seg.size)))
                    .and_then(|_| record::adopted(&seg, file, packer.page_size))
            }
        };
        match checked {
            Ok(a) => good.push((f.name, a)),
            Err(why) => {
                tracing::warn!(name = %f.name, why = %why, "fd store: fd refused, closed and removed from the store");
                if removed.insert(f.name.clone()) {
                    remove(notifier, &f.name);
                }
                out.refused += 1;
            }
        }
    }
    (good, removed)
}

/// Enters the checked segments into the index while the budget allows; one that does not
/// fit is removed from the store.
fn index(
    packer: &Packer,
    good: Vec<(String, Adopted)>,
    removed: &HashSet<String>,
    notifier: &Notifier,
    out: &mut Adoption,
) {
    for (name, a) in good {
        let key = a.key.clone();
        let size = a.size;
        if packer.store.adopt(a, !removed.contains(&name), false).is_some() {
            out.adopted += 1;
            out.bytes += size;
        } else if !packer.store.contains(&key) {
            tracing::warn!(name = %name, bytes = size, "fd store: segment does not fit in the budget; removed");
            remove(notifier, &name);
            out.refused += 1;
        }
    }
}
