//! Model sources: the fd a client sent, checked, hashed and read with positioned reads.
//!
//! The daemon never maps a client's file: its owner could truncate it mid-read and a mapped
//! read would then raise SIGBUS in the daemon. Reads go through `pread`, where truncation is
//! a short read and therefore a clean error. Sources are never opened by path.

mod digest;
mod error;
pub mod safetensors;
pub mod tree;

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub use digest::{Digest, DigestCache, FileIdentity};
pub use error::{Change, HeaderError, SourceError};
pub use packd_kernels::Dtype;
pub use safetensors::{Header, TensorInfo};

/// Progress of the reads of a source: bumped by every completed read, so a watcher can tell
/// a slow source (still reading) from one that stopped answering; and a flag that stops
/// further reads (checked before each one).
#[derive(Debug, Default)]
pub struct Progress {
    reads: AtomicU64,
    bytes: AtomicU64,
    stop: AtomicBool,
}

impl Progress {
    /// Reads completed so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Bytes those reads returned.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Counts one completed read of `bytes` (for work that reads something other than a
    /// [`Source`]).
    pub fn advance(&self, bytes: u64) {
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Makes every further read of the source fail with [`SourceError::Stopped`].
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Whether reads were stopped.
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }
}

/// A received, checked source file.
pub struct Source {
    /// `Some` until the source is dropped.
    file: Option<File>,
    /// Where the file goes then (`None`: closed where the source is dropped).
    release: Option<Release>,
    len: u64,
    identity: FileIdentity,
    progress: Arc<Progress>,
}

/// What becomes of a source's file when the source is dropped, or when the file is refused
/// ([`Source::from_fd_releasing`]): the daemon hands clients' files to threads of their own,
/// since a close can wait for ever (a FUSE mount's flush).
pub type Release = Box<dyn FnOnce(File) + Send + Sync>;

impl Drop for Source {
    fn drop(&mut self) {
        if let (Some(file), Some(release)) = (self.file.take(), self.release.take()) {
            release(file);
        }
    }
}

impl Source {
    /// Takes ownership of a received fd and checks that it is a readable regular file.
    pub fn from_fd(fd: OwnedFd) -> Result<Self, SourceError> {
        Self::from_fd_releasing(fd, None)
    }

    /// [`Source::from_fd`], the file handed to `release` (when given) instead of closed
    /// where the source is dropped, also when it is refused here.
    pub fn from_fd_releasing(fd: OwnedFd, release: Option<Release>) -> Result<Self, SourceError> {
        let file = File::from(fd);
        match Self::check(&file) {
            Ok((len, identity)) => Ok(Self { file: Some(file), release, len, identity, progress: Arc::default() }),
            Err(e) => {
                if let Some(release) = release {
                    release(file);
                }
                Err(e)
            }
        }
    }

    /// The length and identity of `file` if it is a readable regular file.
    fn check(file: &File) -> Result<(u64, FileIdentity), SourceError> {
        let meta = file.metadata().map_err(SourceError::Unreadable)?;
        let ft = meta.file_type();
        if !ft.is_file() {
            let what = if ft.is_dir() {
                "a directory"
            } else if ft.is_socket() {
                "a socket"
            } else if ft.is_fifo() {
                "a pipe"
            } else if ft.is_char_device() {
                "a character device"
            } else if ft.is_block_device() {
                "a block device"
            } else {
                "not a file"
            };
            return Err(SourceError::NotAFile(what));
        }
        let mut probe = [0u8; 1];
        if meta.len() > 0 {
            file.read_at(&mut probe, 0).map_err(SourceError::Unreadable)?;
        }
        Ok((meta.len(), FileIdentity::of(&meta)))
    }

    fn file(&self) -> &File {
        self.file.as_ref().expect("a source holds its file until dropped")
    }

    /// Size of the file when it was received.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Identity (device, inode, size, times) used by the digest cache.
    pub fn identity(&self) -> &FileIdentity {
        &self.identity
    }

    /// The progress of this source's reads (shared with its watcher).
    pub fn progress(&self) -> Arc<Progress> {
        Arc::clone(&self.progress)
    }

    /// Reads exactly `buf.len()` bytes at `offset`; a short read means the file shrank.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<(), SourceError> {
        if self.progress.stopped() {
            return Err(SourceError::Stopped("nobody waits for it, or it stopped answering"));
        }
        self.file().read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                SourceError::Changed(Change::ShortRead { len: buf.len(), offset })
            } else {
                SourceError::Unreadable(e)
            }
        })?;
        self.progress.advance(buf.len() as u64);
        Ok(())
    }

    /// Reads and validates the safetensors header.
    pub fn header(&self) -> Result<(Vec<u8>, Header), SourceError> {
        let mut prefix = [0u8; 8];
        let n = usize::try_from(self.len.min(8)).unwrap_or(8);
        self.read_exact_at(&mut prefix[..n], 0)?;
        let json_len = safetensors::header_len(&prefix[..n], self.len)?;
        let mut raw = vec![0u8; usize::try_from(8 + json_len).map_err(|_| SourceError::Format(HeaderError::TooLarge))?];
        self.read_exact_at(&mut raw, 0)?;
        let header = safetensors::parse_header(&raw[8..], self.len)?;
        Ok((raw, header))
    }

    /// BLAKE3 of the whole file, its parts read and hashed on every core ([`tree`]).
    pub fn digest(&self) -> Result<Digest, SourceError> {
        self.digest_on(std::thread::available_parallelism().map_or(1, usize::from))
    }

    /// [`Source::digest`] on `threads` threads.
    pub fn digest_on(&self, threads: usize) -> Result<Digest, SourceError> {
        let hash = tree::hash(self.len, threads.max(1), |offset, buf: &mut [u8]| self.read_exact_at(buf, offset))?;
        Ok(Digest(*hash.as_bytes()))
    }

    /// Re-reads the identity and fails if the file changed since it was received.
    pub fn check_unchanged(&self) -> Result<(), SourceError> {
        let meta = self.file().metadata().map_err(SourceError::Unreadable)?;
        let now = FileIdentity::of(&meta);
        if now != self.identity || meta.size() != self.len {
            return Err(SourceError::Changed(Change::Stat));
        }
        Ok(())
    }
}
