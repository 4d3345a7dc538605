//! How packd reads and writes the files of its cache directory: regular files only, never
//! through a symlink, private to its user, replaced whole.

/// Opens `path` for reading as a regular file: never blocks on a FIFO (`O_NONBLOCK`), never
/// follows a final symlink, and refuses anything but a regular file (a device such as
/// `/dev/zero` would read without end). For the files packd keeps in its cache directory,
/// read at start before it is ready.
pub fn open_regular(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)?;
    if !file.metadata()?.file_type().is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "not a regular file"));
    }
    Ok(file)
}

/// Creates the directory `dir` (and its parents) private to packd's user (0700), whatever
/// the umask: the first of packd's files to be written may create the cache directory.
pub fn create_private_dir(dir: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

/// Creates (or truncates) `path` for writing, private to packd's user (0600) whatever the
/// umask, never through a final symlink.
pub fn create_private(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

/// Replaces `dir/name` with `bytes` whole: written to a private temporary file, synced, then
/// renamed over it; on any failure (a full disk) the temporary file is removed.
pub fn replace_file(dir: &std::path::Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let written = (|| {
        let mut f = create_private(&tmp)?;
        f.write_all(bytes)?;
        f.sync_data()?;
        drop(f);
        std::fs::rename(&tmp, dir.join(name))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// The bytes of the regular file at `path` ([`open_regular`]) if it holds at most `max`.
pub fn read_regular(path: &std::path::Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = open_regular(path)?;
    let len = file.metadata()?.len();
    if len > max {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{len} bytes, more than {max}")));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    // `take`: a file that grows meanwhile is still read only up to the bound.
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("more than {max} bytes")));
    }
    Ok(bytes)
}
