//! Server-side packing of files under the configured model roots.
//!
//! The only place packd opens a path, and only one an operator configured: the path must
//! resolve (symlinks followed) to a regular file inside a model root; `..` components are
//! refused outright, and the final open does not follow a symlink swapped in afterwards.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use packd_proto::v1;
use tonic::Status;

use super::codes::grpc_code;
use super::plane::ControlPlane;
use crate::pack::Plan;
use crate::service::{self, Failure};
use crate::source::Source;

/// A failure as a gRPC status: its code mapped once ([`Failure::code`], [`grpc_code`]).
fn status(f: &Failure) -> Status {
    Status::new(grpc_code(f.code()), f.to_string())
}
use crate::store::Segment;

/// Resolves `path` against the roots; returns the canonical path inside a root.
fn resolve(roots: &[PathBuf], path: &str) -> Result<PathBuf, Status> {
    if roots.is_empty() {
        return Err(Status::failed_precondition("no model roots are configured (start packd with --model-root DIR)"));
    }
    let p = Path::new(path);
    if path.is_empty() || p.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(Status::permission_denied(format!("path {path:?} is empty or contains '..'")));
    }
    let candidates: Vec<PathBuf> =
        if p.is_absolute() { vec![p.to_path_buf()] } else { roots.iter().map(|r| r.join(p)).collect() };
    let mut last = None;
    for c in candidates {
        match c.canonicalize() {
            Ok(real) if roots.iter().any(|r| real.starts_with(r)) => return Ok(real),
            Ok(real) => {
                last = Some(Status::permission_denied(format!(
                    "{path:?} resolves to {} outside the model roots",
                    real.display()
                )))
            }
            Err(e) => last = Some(Status::not_found(format!("{}: {e}", c.display()))),
        }
    }
    Err(last.unwrap_or_else(|| Status::not_found(path.to_string())))
}

/// Packs the file at `req.path` (under a model root) with the request's plan. Resolving,
/// opening and checking the path run on the source pool (a model root on a hung file
/// system fails this request within `limits.source_timeout`); the open never blocks on a
/// FIFO (`O_NONBLOCK`) and never follows a final symlink.
pub async fn prefetch(plane: &ControlPlane, uid: u32, req: v1::PrefetchRequest) -> Result<Arc<Segment>, Status> {
    let plan = Plan::new(&req.rules, &req.layout).map_err(|e| Status::invalid_argument(e.to_string()))?;
    let roots = plane.model_roots.get();
    let path = req.path.clone();
    // A file of a model root on a hung file system: closed off the runtime and the pool.
    let release = plane.packer.source_ops.releaser(uid);
    let opened = plane
        .packer
        .source_ops
        .run(uid, "the open", None, move || {
            let real = resolve(&roots, &path)?;
            let file = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
                .open(&real)
                .map_err(|e| Status::not_found(format!("{}: {e}", real.display())))?;
            let source =
                Source::from_fd_releasing(file.into(), Some(release)).map_err(|e| status(&Failure::from(e)))?;
            Ok::<_, Status>((real, source))
        })
        .await
        .map_err(|e| status(&Failure::Op(e)))?;
    let (real, source) = opened?;
    let name = real.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let who =
        service::Requester { uid, cancellable: false, label: crate::store::label(&name), track: Default::default() };
    let (seg, _) = service::pack_source(&plane.packer, who, source, plan).await.map_err(|f| status(&f))?;
    tracing::info!(path = %real.display(), key = %seg.key, "prefetched");
    Ok(seg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_must_stay_inside_the_roots() {
        let dir = std::env::temp_dir().join(format!("packd-roots-{}", std::process::id()));
        let root = dir.join("models");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("m.safetensors"), b"x").unwrap();
        std::fs::write(dir.join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(dir.join("secret"), root.join("escape")).unwrap();
        let roots = vec![root.canonicalize().unwrap()];
        assert!(resolve(&roots, "m.safetensors").is_ok());
        assert!(resolve(&roots, root.join("m.safetensors").to_str().unwrap()).is_ok());
        assert_eq!(resolve(&roots, "../secret").unwrap_err().code(), tonic::Code::PermissionDenied);
        assert_eq!(resolve(&roots, "escape").unwrap_err().code(), tonic::Code::PermissionDenied);
        assert_eq!(
            resolve(&roots, dir.join("secret").to_str().unwrap()).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert_eq!(resolve(&roots, "missing").unwrap_err().code(), tonic::Code::NotFound);
        assert_eq!(resolve(&[], "m.safetensors").unwrap_err().code(), tonic::Code::FailedPrecondition);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
