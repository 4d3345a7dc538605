//! `digest`: the BLAKE3 of a model file an engine maps, computed once per host.
//!
//! Engine adapters name a model by its content. Each worker hashing the file itself costs
//! N hashes when N workers start together; here the daemon hashes it once: the digest is
//! remembered by the file's identity (device, inode, size, mtime, ctime) in the digest
//! cache that pack requests use (and that the cache directory keeps), and requests for a
//! file being hashed wait for that hash (single flight). The read runs on the source pool,
//! within `limits.source_timeout`, never on the runtime's threads. A request that names
//! `build_bytes` and hashes the file has a memfd allocated for its build meanwhile
//! (`store::lend`). One asked `background` (beside a build under way) hashes on one core
//! fewer than the host has.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use packd_proto::v1;

use super::{DataPlane, Outcome};
use crate::service::{self, Failure, Track};
use crate::source::SourceError;
use crate::store::ClientId;

/// Answers connection `client`'s digest request for the file `fd`.
pub async fn file_digest(
    plane: &Arc<DataPlane>,
    client: ClientId,
    uid: u32,
    id: u64,
    fd: OwnedFd,
    (build_bytes, background): (u64, bool),
    track: &Track,
) -> Outcome {
    match digest_of(plane, client, uid, fd, (build_bytes, background), track).await {
        Ok(reply) => Outcome::Digest { id, reply },
        Err(failure) => Outcome::Error { id, code: failure.code(), message: failure.to_string() },
    }
}

async fn digest_of(
    plane: &Arc<DataPlane>,
    client: ClientId,
    uid: u32,
    fd: OwnedFd,
    (build_bytes, background): (u64, bool),
    track: &Track,
) -> Result<v1::FileDigestReply, Failure> {
    if build_bytes > 0 {
        plane.packer.lends.asked(client);
    }
    // However the request ends, memory parked for it waits the claim timeout from then.
    struct Replied<'a>(&'a crate::store::Lends, ClientId);
    impl Drop for Replied<'_> {
        fn drop(&mut self) {
            self.0.hashed(self.1);
        }
    }
    let _replied = Replied(&plane.packer.lends, client);
    let source = service::open_source(&plane.packer, uid, fd).await?;
    let (packer, track) = (Arc::clone(&plane.packer), track.clone());
    let size = source.len();
    let progress = source.progress();
    let found = plane
        .packer
        .source_ops
        .run(uid, "a read", Some(progress), move || {
            let mut hashed = false;
            let digest = packer.digests.get_or_compute(source.identity(), || {
                hashed = true;
                // The first to ask builds, most likely: its memory is allocated meanwhile.
                let _ = packer.lends.park(&packer.store, client, uid, build_bytes, size);
                if background {
                    // Beside a build: on one core fewer than the host has, so the build keeps
                    // one. Not at a lower priority: the build's waiters wait for this hash
                    // through its publication, and on a busy host a niced hash would starve.
                    let threads = std::thread::available_parallelism().map_or(1, usize::from).saturating_sub(1);
                    return service::hash_whole_on(&source, &track, "model file hashed beside a build", threads);
                }
                service::hash_whole(&source, &track, "model file hashed for a digest request")
            })?;
            if hashed {
                packer.store.digest_learned();
            }
            Ok::<_, SourceError>(v1::FileDigestReply { blake3: digest.0.to_vec(), size: source.len(), hashed })
        })
        .await?;
    found.map_err(Failure::from)
}
