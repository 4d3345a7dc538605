//! A per-user memo of content names, so that a worker does not hash what an earlier worker
//! hashed, and the digest of a whole model file an engine maps.
//!
//! A name is `c:` and 32 hex digits of a BLAKE3 (an adapter's: of a tensor's packing
//! parameters and bytes; of a whole file). Hashing is the one cost a served worker pays per
//! weight byte, so names are remembered, where that is safe, by where the bytes come from:
//! a [`Span`] whose bytes lie in a **read-only** mapping of a regular file (ExecuTorch maps
//! its `.pte` constants so, llama.cpp its GGUF) is keyed by the file's identity — device,
//! inode, size, modification and change times in nanoseconds, all checked against the
//! mapping — and the span's offset, length and parameters. Any write to the file changes its change time, so a remembered name is never
//! used for other bytes. The memo is a directory of small text files, one per file identity
//! (`$PACKD_NAMES`, else the older name `$PACKD_XNNPACK_NAMES`, else
//! `$XDG_CACHE_HOME/packd/names`, else `~/.cache/packd/names`; `off` turns it off); only
//! this user writes it (created 0700), and a line that does not parse is ignored. Memory
//! that is not such a mapping is hashed every time.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

use crate::maps::{Lookup, Mapping};

/// Bytes of this process an adapter names: where they are, how many, and what else the name
/// covers (an XNNPACK tensor's packing parameters).
#[derive(Clone, Debug)]
pub struct Span {
    /// Where its bytes are.
    pub ptr: usize,
    /// How many.
    pub len: usize,
    /// Everything else the name covers, serialised.
    pub params: Vec<u8>,
}

/// Why a file has no digest.
#[derive(Debug, thiserror::Error)]
pub enum DigestError {
    #[error("the source bytes are not a read-only mapping of a regular file")]
    NotAFileMapping,
    #[error("cannot open {path}: {source}")]
    Open { path: String, source: std::io::Error },
    #[error("{path} is no longer the file mapped")]
    Replaced { path: String },
    #[error("packd could not hash {path}: {source}")]
    Daemon { path: String, source: packd_client::Error },
    #[error("{path} changed while it was hashed")]
    Changed { path: String },
    #[error("cannot start hashing threads: {0}")]
    Threads(#[from] rayon::ThreadPoolBuildError),
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
}

/// Most bytes of memo read or written per source file.
const MAX_MEMO: u64 = 8 << 20;

/// The read-only mapping of a file holding `addr`, if that is what holds it. (Not
/// detected: a private mapping the process wrote while it was writable and then made
/// read-only, whose copied pages differ from the file; see INTEGRATION.md.)
fn file_mapping(maps: &mut Lookup, addr: usize) -> Option<Mapping> {
    maps.at(addr).filter(|m| {
        m.perms.starts_with("r-") && m.inode != 0 && m.path.starts_with('/') && !m.path.ends_with("(deleted)")
    })
}

/// The identity of a source file as the memo keys it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl FileId {
    fn of(md: &std::fs::Metadata) -> Self {
        Self {
            dev: md.dev(),
            ino: md.ino(),
            size: md.size(),
            mtime_ns: i128::from(md.mtime()) * 1_000_000_000 + i128::from(md.mtime_nsec()),
            ctime_ns: i128::from(md.ctime()) * 1_000_000_000 + i128::from(md.ctime_nsec()),
        }
    }

    fn file_name(&self) -> String {
        format!("{:x}-{:x}-{:x}-{:x}-{:x}", self.dev, self.ino, self.size, self.mtime_ns, self.ctime_ns)
    }
}

/// The file and offset a tensor's bytes are mapped from, checked against the file now.
fn sources(spans: &[Span]) -> Vec<Option<(FileId, u64)>> {
    let mut maps = Lookup::new();
    let mut stats: HashMap<String, Option<FileId>> = HashMap::new();
    spans
        .iter()
        .map(|t| {
            let end = t.ptr.checked_add(t.len)?;
            let m = file_mapping(&mut maps, t.ptr)?;
            // The bytes may run on into the next mappings of the same file at the following
            // offsets (an engine maps each constant's pages apart).
            let mut a = m.clone();
            while end > a.hi {
                let b = file_mapping(&mut maps, a.hi)?;
                let next = b.lo == a.hi && b.inode == a.inode && b.dev == a.dev && b.path == a.path;
                if !next || b.offset != a.offset + (a.hi - a.lo) as u64 {
                    return None;
                }
                a = b;
            }
            let id = stats
                .entry(m.path.clone())
                .or_insert_with(|| {
                    let md = std::fs::metadata(&m.path).ok()?;
                    let dev = md.dev();
                    let (maj, min) = (libc::major(dev) as u64, libc::minor(dev) as u64);
                    (md.is_file() && md.ino() == m.inode && (maj, min) == m.dev).then(|| FileId {
                        dev,
                        ino: md.ino(),
                        size: md.size(),
                        mtime_ns: i128::from(md.mtime()) * 1_000_000_000 + i128::from(md.mtime_nsec()),
                        ctime_ns: i128::from(md.ctime()) * 1_000_000_000 + i128::from(md.ctime_nsec()),
                    })
                })
                .clone()?;
            Some((id, m.offset + (t.ptr - m.lo) as u64))
        })
        .collect()
}

/// The memo's directory, `None` when turned off.
fn memo_dir() -> Option<PathBuf> {
    memo_dir_from(|name| std::env::var_os(name))
}

/// [`memo_dir`] with the environment read through `var`.
fn memo_dir_from(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let set = |name| var(name).filter(|v| !v.is_empty());
    match set("PACKD_NAMES").or_else(|| set("PACKD_XNNPACK_NAMES")) {
        Some(v) if v == "off" => None,
        Some(v) => Some(PathBuf::from(v)),
        None => {
            let base = set("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| set("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
            Some(base.join("packd").join("names"))
        }
    }
}

/// The memo key of a span in a file: offset, length and its parameters' digest.
fn key(offset: u64, t: &Span) -> String {
    format!("{offset:x} {:x} {}", t.len, &blake3::hash(&t.params).to_hex()[..32])
}

fn valid_name(n: &str) -> bool {
    n.len() == 34 && n.starts_with("c:") && n[2..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// What the memo remembers for `file`: key → name.
fn read_memo(dir: &std::path::Path, file: &FileId) -> HashMap<String, String> {
    let path = dir.join(file.file_name());
    let ok = std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() <= MAX_MEMO);
    let text = if ok { std::fs::read_to_string(&path).unwrap_or_default() } else { String::new() };
    text.lines()
        .filter_map(|line| {
            let (k, name) = line.rsplit_once(' ')?;
            valid_name(name).then(|| (k.to_string(), name.to_string()))
        })
        .collect()
}

/// Appends new lines to the memo of `file` (whole lines in one write; best effort).
fn append_memo(dir: &std::path::Path, file: &FileId, lines: &[String]) {
    if lines.is_empty() || std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).is_err() {
        return;
    }
    let path = dir.join(file.file_name());
    if std::fs::metadata(&path).is_ok_and(|m| m.len() > MAX_MEMO) {
        return;
    }
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let opened = std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(&path);
    if let Ok(mut f) = opened {
        let _ = f.write_all(text.as_bytes());
    }
}

/// Each span's remembered name (`None`: to be hashed), and how to remember the rest.
pub struct Memo {
    dir: Option<PathBuf>,
    sources: Vec<Option<(FileId, u64)>>,
    pub known: Vec<Option<String>>,
}

impl Memo {
    /// Looks the spans up in the memo (in `$PACKD_NAMES`, see the module's text).
    pub fn look_up(tensors: &[Span]) -> Self {
        let dir = memo_dir();
        let sources = if dir.is_some() { sources(tensors) } else { vec![None; tensors.len()] };
        let mut memos: HashMap<FileId, HashMap<String, String>> = HashMap::new();
        let known = tensors
            .iter()
            .zip(&sources)
            .map(|(t, s)| {
                let (dir, (file, offset)) = (dir.as_ref()?, s.as_ref()?);
                let memo = memos.entry(file.clone()).or_insert_with(|| read_memo(dir, file));
                memo.get(&key(*offset, t)).cloned()
            })
            .collect();
        Self { dir, sources, known }
    }

    /// Each span's **provisional name**, when every span lies in a file the memo can key
    /// (and the memo is on): `p:` and 32 hex digits of a BLAKE3 of the file's identity and
    /// the span's memo key (offset, length, parameters). It stands for the bytes as long as
    /// the file is unchanged (as a memo line does), and costs no hashing of the bytes: a
    /// builder may take its role under names made of these while the content names are
    /// computed beside the build (checked with [`Memo::unchanged`] after). `None` otherwise.
    pub fn provisional(&self, tensors: &[Span]) -> Option<Vec<String>> {
        self.dir.as_ref()?;
        tensors
            .iter()
            .zip(&self.sources)
            .map(|(t, s)| {
                let (file, offset) = s.as_ref()?;
                let id = format!("{} {}", file.file_name(), key(*offset, t));
                Some(format!("p:{}", &blake3::hash(id.as_bytes()).to_hex()[..32]))
            })
            .collect()
    }

    /// Whether every span still lies in the file it lay in when looked up, at the same
    /// offset, and those files are unchanged (device, inode, size, times).
    pub fn unchanged(&self, tensors: &[Span]) -> bool {
        sources(tensors) == self.sources
    }

    /// Remembers the names hashed now (those `known` lacked) of spans that come from a file.
    pub fn remember(&self, tensors: &[Span], names: &[String]) {
        let Some(dir) = &self.dir else { return };
        let mut new: HashMap<&FileId, Vec<String>> = HashMap::new();
        for ((t, s), (known, name)) in tensors.iter().zip(&self.sources).zip(self.known.iter().zip(names)) {
            if let (Some((file, offset)), None) = (s, known)
                && valid_name(name)
            {
                new.entry(file).or_default().push(format!("{} {name}", key(*offset, t)));
            }
        }
        for (file, lines) in new {
            append_memo(dir, file, &lines);
        }
    }
}

/// The content digest of a whole file an engine maps read-only (a GGUF model), as
/// [`mapped_file_digest`] finds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileDigest {
    /// The file's path.
    pub path: String,
    /// `c:` and 32 hex digits of the BLAKE3 of the whole file.
    pub name: String,
    /// The file's size.
    pub size: u64,
    /// Whether the memo knew it (nothing hashed).
    pub remembered: bool,
    /// Whether packd gave it (it hashes a file once per host; this process hashed nothing).
    pub from_daemon: bool,
}

/// The whole file's BLAKE3 as packd computes it ([`packd_client::Client::file_digest`]), for the
/// file `path` whose identity must be `file`: opened, checked to be that file, sent (with
/// the bytes this process would build from it, see [`mapped_file_digest`]).
fn daemon_digest(
    daemon: &packd_client::Client,
    model: &MappedFile,
    build_bytes: Option<u64>,
) -> Result<String, DigestError> {
    let (path, file) = (model.shown(), &model.file);
    let reopened;
    let f = match &model.opened {
        Some(f) => f,
        None => {
            reopened =
                std::fs::File::open(&model.path).map_err(|source| DigestError::Open { path: path.clone(), source })?;
            &reopened
        }
    };
    let md = f.metadata().map_err(|source| DigestError::Open { path: path.clone(), source })?;
    if FileId::of(&md) != *file {
        return Err(DigestError::Replaced { path });
    }
    // None: beside a build under way (packd leaves the build a core).
    let d = match build_bytes {
        Some(b) => daemon.file_digest_for_build(f, b),
        None => daemon.file_digest_beside_build(f),
    }
    .map_err(|source| DigestError::Daemon { path: path.clone(), source })?;
    if d.size != file.size {
        return Err(DigestError::Changed { path });
    }
    Ok(format!("c:{}", &blake3::Hash::from_bytes(d.blake3).to_hex()[..32]))
}

/// The digest of the whole regular file mapped read-only at `addr`, remembered in the memo
/// by the file's identity (as tensor names are, under a key no tensor uses), else read and
/// hashed from the file — and then the file's identity is checked again, so that a file
/// written meanwhile is never remembered with the wrong digest. An error says why there is
/// none (not a read-only file mapping, the file changed, cannot be read).
///
/// With `daemon`, a file the memo does not know is hashed by packd (once per host: workers
/// starting together share one hash); this process hashes it only when packd cannot. A
/// process that would build `build_bytes` from the file (0: none) has packd allocate that
/// memory while it hashes, if it is the first to ask ([`packd_client::Client::file_digest_for_build`]).
pub fn mapped_file_digest(
    addr: usize,
    daemon: Option<&packd_client::Client>,
    build_bytes: u64,
) -> Result<FileDigest, DigestError> {
    let model = MappedFile::at(addr)?;
    if let Some(known) = model.remembered() {
        return Ok(known);
    }
    let digest = model.digest(daemon, Some(build_bytes))?;
    model.remember(&digest.name);
    Ok(digest)
}

/// A model file, as the memo keys it: its identity and path, and the file itself when the
/// engine opened it by path (hashed and checked through that fd, whatever the path names
/// later).
struct MappedFile {
    file: FileId,
    path: PathBuf,
    opened: Option<std::fs::File>,
}

impl MappedFile {
    /// The file mapped read-only at `addr`.
    fn at(addr: usize) -> Result<Self, DigestError> {
        let probe = Span { ptr: addr, len: 1, params: Vec::new() };
        let Some(Some((file, _))) = sources(std::slice::from_ref(&probe)).into_iter().next() else {
            return Err(DigestError::NotAFileMapping);
        };
        let path = file_mapping(&mut Lookup::new(), addr).map(|m| m.path).unwrap_or_default();
        Ok(Self { file, path: PathBuf::from(path), opened: None })
    }

    /// The regular file `file`, opened from `path` (a duplicate of its fd is kept).
    fn opened(path: &std::path::Path, file: &std::fs::File) -> Result<Self, DigestError> {
        let shown = || path.display().to_string();
        let md = file.metadata().map_err(|source| DigestError::Open { path: shown(), source })?;
        if !md.is_file() {
            return Err(DigestError::NotAFileMapping);
        }
        let opened = file.try_clone().map_err(|source| DigestError::Open { path: shown(), source })?;
        Ok(Self { file: FileId::of(&md), path: path.to_path_buf(), opened: Some(opened) })
    }

    /// Its path, for people.
    fn shown(&self) -> String {
        self.path.display().to_string()
    }

    /// The memo's key of the whole file's digest.
    fn whole_key(&self) -> String {
        let whole =
            Span { ptr: 0, len: usize::try_from(self.file.size).unwrap_or(usize::MAX), params: b"file".to_vec() };
        key(0, &whole)
    }

    /// Its digest, if the memo knows it.
    fn remembered(&self) -> Option<FileDigest> {
        let name = memo_dir().and_then(|d| read_memo(&d, &self.file).remove(&self.whole_key()))?;
        Some(FileDigest { path: self.shown(), name, size: self.file.size, remembered: true, from_daemon: false })
    }

    /// Remembers its digest `name` in the memo.
    fn remember(&self, name: &str) {
        if let Some(d) = memo_dir() {
            append_memo(&d, &self.file, &[format!("{} {name}", self.whole_key())]);
        }
    }

    /// Its digest from packd (or hashed here; then checked against the file again).
    /// `build_bytes` None: beside a build under way (packd leaves the build a core).
    fn digest(
        &self,
        daemon: Option<&packd_client::Client>,
        build_bytes: Option<u64>,
    ) -> Result<FileDigest, DigestError> {
        let (path, size) = (self.shown(), self.file.size);
        if let Some(name) = daemon.and_then(|c| daemon_digest(c, self, build_bytes).ok()) {
            return Ok(FileDigest { path, name, size, remembered: false, from_daemon: true });
        }
        // On every core (a pool of this call's own, gone when it returns), over a mapping of
        // the file: its pages are in the page cache already (the engine mapped them).
        let threads = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|_| "packd-hash".into()).build()?;
        let mut h = blake3::Hasher::new();
        let read = match &self.opened {
            // Read through the engine's own fd (at offsets: its file position is left as it
            // is), whatever the path names now.
            Some(f) => hash_at(&mut h, f, size),
            None => pool.install(|| h.update_mmap_rayon(&self.path).map(|_| ())),
        };
        read.map_err(|source| DigestError::Read { path: path.clone(), source })?;
        let name = format!("c:{}", &h.finalize().to_hex()[..32]);
        // The file must still be the one the mapping showed (same size and times).
        self.unchanged()?;
        Ok(FileDigest { path, name, size, remembered: false, from_daemon: false })
    }

    /// Whether the file at its path is still the one it was (device, inode, size, times).
    fn unchanged(&self) -> Result<(), DigestError> {
        // The file itself (through the engine's fd, when it opened one) and what its path
        // names now.
        let fd_same = self.opened.as_ref().is_none_or(|f| f.metadata().is_ok_and(|md| FileId::of(&md) == self.file));
        let now = std::fs::metadata(&self.path).ok().map(|md| FileId::of(&md));
        if fd_same && now.as_ref() == Some(&self.file) {
            Ok(())
        } else {
            Err(DigestError::Changed { path: self.shown() })
        }
    }
}

/// Feeds `len` bytes of `f` from its start to `h`, read at offsets.
fn hash_at(h: &mut blake3::Hasher, f: &std::fs::File, len: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < len {
        let n = f.read_at(&mut buf, at)?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        h.update(&buf[..n]);
        at += n as u64;
    }
    Ok(())
}

/// How the files a model is made of (one GGUF; an ONNX model and its external data) are
/// named before a build may start: by their content digests when the memo knows them all,
/// else by a **provisional name** made of the files' identities (device, inode, size,
/// modification and change times in nanoseconds: `f:` and hex), which a builder may take its
/// role under and publish with as an alias while the digests are computed beside the build
/// (PROTOCOL.md, "Building under a provisional name").
pub enum ModelName {
    /// The content digests, in the files' order (the memo knew them: nothing hashed).
    Known(Vec<FileDigest>),
    /// Not known yet.
    Provisional(Provisional),
}

/// Model files named by their identities, their digests not known yet ([`ModelName`]).
pub struct Provisional {
    files: Vec<MappedFile>,
}

impl Provisional {
    /// The provisional name: `f:` and the files' identities, printable.
    pub fn name(&self) -> String {
        let ids: Vec<String> = self.files.iter().map(|f| f.file.file_name()).collect();
        format!("f:{}", ids.join("+"))
    }

    /// Starts computing the content digests on a thread of its own (packd's, each file in
    /// turn, else hashed there), beside the build. Err: the thread could not start. They
    /// are remembered in the memo only once the build is published ([`Named::remember`]):
    /// until then a worker that starts finds no digest, makes the same provisional name and
    /// waits for the build (with the digests it would ask for the content identity, and
    /// build again).
    pub fn digest_beside(self, daemon: Option<packd_client::Client>) -> std::io::Result<PendingDigest> {
        let files = std::sync::Arc::new(self.files);
        let f = std::sync::Arc::clone(&files);
        let handle = std::thread::Builder::new()
            .name("packd-digest".into())
            .spawn(move || f.iter().map(|file| file.digest(daemon.as_ref(), None)).collect())?;
        Ok(PendingDigest { files, handle })
    }
}

/// Model files' digests being computed beside a build ([`Provisional::digest_beside`]).
pub struct PendingDigest {
    files: std::sync::Arc<Vec<MappedFile>>,
    handle: std::thread::JoinHandle<Result<Vec<FileDigest>, DigestError>>,
}

impl PendingDigest {
    /// Waits for the digests, then checks that every file is still the one the provisional
    /// name was made of: a file changed during the build gives [`DigestError::Changed`], and
    /// nothing built from it may be published (its bytes may be a mix of both contents).
    pub fn finish(self) -> Result<Named, DigestError> {
        let digests = self.handle.join().unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        for f in self.files.iter() {
            f.unchanged()?;
        }
        Ok(Named { digests, files: self.files })
    }
}

/// Model files' digests found beside their build ([`PendingDigest::finish`]).
pub struct Named {
    /// The digests, in the files' order.
    pub digests: Vec<FileDigest>,
    files: std::sync::Arc<Vec<MappedFile>>,
}

impl Named {
    /// Remembers the digests in the memo (once the build is published under them).
    pub fn remember(&self) {
        for (f, d) in self.files.iter().zip(&self.digests) {
            f.remember(&d.name);
        }
    }
}

/// Names the regular file mapped read-only at `addr` ([`ModelName`]): its content digest if
/// the memo knows it, else its provisional name. Hashes nothing. With
/// `PACKD_PROVISIONAL_NAMES=off` there are no provisional names: a digest the memo does not
/// know is found as [`mapped_file_digest`] finds it (asking packd with `build_bytes`, which
/// may lend the memory to build in while it hashes), before any build starts.
pub fn name_mapped_file(
    addr: usize,
    daemon: Option<&packd_client::Client>,
    build_bytes: u64,
) -> Result<ModelName, DigestError> {
    name_files(vec![MappedFile::at(addr)?], daemon, build_bytes)
}

/// [`name_mapped_file`] for files an engine opens by path (`(path, opened file)`, in the
/// order the identity names them): their digests if the memo knows them all, else their
/// provisional name; with `PACKD_PROVISIONAL_NAMES=off`, their digests from packd (each
/// remembered).
pub fn name_opened_files(
    files: &[(&std::path::Path, &std::fs::File)],
    daemon: Option<&packd_client::Client>,
) -> Result<ModelName, DigestError> {
    let files = files.iter().map(|(p, f)| MappedFile::opened(p, f)).collect::<Result<Vec<_>, _>>()?;
    name_files(files, daemon, 0)
}

fn name_files(
    files: Vec<MappedFile>,
    daemon: Option<&packd_client::Client>,
    build_bytes: u64,
) -> Result<ModelName, DigestError> {
    if let Some(known) = files.iter().map(MappedFile::remembered).collect::<Option<Vec<_>>>() {
        return Ok(ModelName::Known(known));
    }
    if !provisional_names() {
        let mut known = Vec::new();
        for f in &files {
            let digest = f.digest(daemon, Some(build_bytes))?;
            f.remember(&digest.name);
            known.push(digest);
        }
        return Ok(ModelName::Known(known));
    }
    Ok(ModelName::Provisional(Provisional { files }))
}

/// Whether builds may start under provisional names (`PACKD_PROVISIONAL_NAMES`, on unless
/// `off`, `0` or `false`).
pub fn provisional_names() -> bool {
    !std::env::var("PACKD_PROVISIONAL_NAMES").is_ok_and(|v| matches!(v.as_str(), "off" | "0" | "false"))
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::path::PathBuf;

    use super::memo_dir_from;

    fn dir(env: &[(&str, &str)]) -> Option<PathBuf> {
        memo_dir_from(|name| env.iter().find(|(k, _)| *k == name).map(|(_, v)| OsString::from(v)))
    }

    #[test]
    fn the_memo_is_found_by_its_name_then_its_older_name_then_the_user_cache() {
        let home = [("HOME", "/h")];
        assert_eq!(dir(&home), Some(PathBuf::from("/h/.cache/packd/names")));
        assert_eq!(dir(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]), Some(PathBuf::from("/x/packd/names")));
        assert_eq!(dir(&[("HOME", "/h"), ("PACKD_XNNPACK_NAMES", "/old")]), Some(PathBuf::from("/old")));
        let both = [("PACKD_XNNPACK_NAMES", "/old"), ("PACKD_NAMES", "/new")];
        assert_eq!(dir(&both), Some(PathBuf::from("/new")));
        assert_eq!(dir(&[("PACKD_NAMES", "off"), ("PACKD_XNNPACK_NAMES", "/old")]), None);
        assert_eq!(dir(&[("PACKD_XNNPACK_NAMES", "off")]), None);
        assert_eq!(dir(&[("PACKD_NAMES", "")]), None, "no home: no memo");
    }
}
