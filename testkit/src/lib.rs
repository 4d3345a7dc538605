//! Test and benchmark support for packd, shared by the end-to-end tests (`tests/`) and
//! `packctl bench`: nothing here is part of the service.
//!
//! * [`supervisor`]: a stand-in for systemd's side of the service protocol (notifications,
//!   the fd store, socket activation), for machines where systemd does not run.
//! * [`scratch_dir`]: a private scratch directory, removed when dropped.
//! * [`Rng`]: a small reproducible random number generator for workloads.
//! * [`daemon_pid`]: the pid of the daemon serving a socket directory.
//! * [`check_in_place`]: the cache-file reading packd measured and did not choose.
//!
//! Dependencies point one way: this crate uses the daemon's library and the protocol
//! crate; neither of them uses it.

pub mod pack_bench;
pub mod safetensors;
pub mod supervisor;
mod sys;
mod wait;

use std::os::unix::fs::FileExt;
use std::path::Path;

use packd::persist::cache::{self, Opened};
use packd::persist::{PersistError, record};
use packd::store::Adopted;
pub use wait::wait_until;

/// A fresh private scratch directory (mode 0700, unpredictable name) under `$TMPDIR`,
/// or under `/var/tmp` with `on_disk` (for files that must not live in memory);
/// removed with its contents when dropped.
pub fn scratch_dir(prefix: &str, on_disk: bool) -> std::io::Result<tempfile::TempDir> {
    let var_tmp = Path::new("/var/tmp");
    let base = if on_disk && var_tmp.is_dir() { var_tmp.to_path_buf() } else { std::env::temp_dir() };
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new().prefix(prefix).permissions(std::fs::Permissions::from_mode(0o700)).tempdir_in(base)
}

/// The `kB` fields of `/proc/PID/smaps`, in bytes, summed over the mappings whose header
/// line (`address perms offset dev inode path`) `keep` accepts; empty if the file cannot
/// be read.
pub fn smaps_sums(pid: u32, keep: impl Fn(&str) -> bool) -> std::collections::HashMap<String, u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap_or_default();
    let mut sums = std::collections::HashMap::new();
    let mut inside = false;
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let first = it.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            inside = keep(line);
        } else if inside
            && let (Some(key), Some(Ok(kb)), Some("kB")) =
                (first.strip_suffix(':'), it.next().map(str::parse::<u64>), it.next())
        {
            *sums.entry(key.to_string()).or_insert(0) += kb * 1024;
        }
    }
    sums
}

/// Whether a `/proc/PID/smaps` mapping header line describes a writable mapping.
pub fn writable_mapping(header: &str) -> bool {
    header.split_whitespace().nth(1).is_some_and(|perms| perms.contains('w'))
}

/// The pid of the daemon serving `dir`, from the peer credentials of a data-plane
/// connection.
pub fn daemon_pid(dir: &Path) -> std::io::Result<u32> {
    let s = std::os::unix::net::UnixStream::connect(dir.join(packd_proto::DATA_SOCKET))?;
    let cred = nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)?;
    u32::try_from(cred.pid()).map_err(|_| std::io::Error::other("the peer has no pid"))
}

/// Small, fast, reproducible: xorshift64*.
pub struct Rng(u64);

impl Rng {
    /// A generator whose sequence is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next_u64() % n.max(1) as u64).unwrap_or(0)
    }

    /// A number in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The alternative packd measured and did not choose (docs/OPERATIONS.md): check the
/// cache file where it lies, reading it once, so its read-only fd could be served as is.
pub fn check_in_place(path: &Path, page: u64) -> Result<Adopted, PersistError> {
    let Opened { file, record: rec, data_offset } = cache::open(path)?;
    let reader = file.try_clone().map_err(PersistError::io("duplicating the fd"))?;
    let adopted = record::adopted(&rec, file, page)?;
    record::verify_reader(&adopted, |buf, at| {
        reader.read_exact_at(buf, data_offset + at).map_err(PersistError::io("reading the data"))
    })?;
    Ok(adopted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rng_is_reproducible_and_stays_in_range() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let xs: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        assert_eq!(xs, (0..8).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert_ne!(xs[0], Rng::new(8).next_u64());
        assert!((0..1000).all(|_| a.below(3) < 3 && (0.0..1.0).contains(&a.unit())));
        assert_eq!(a.below(0), 0);
    }

    #[test]
    fn scratch_dirs_are_private_and_go_away() {
        let d = scratch_dir("packd-testkit-", false).unwrap();
        let path = d.path().to_path_buf();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o700);
        drop(d);
        assert!(!path.exists());
    }
}
