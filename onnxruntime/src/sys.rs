//! This crate's `unsafe`: hooks on the calls through which ONNX Runtime opens a model's
//! external data file, so that a placeholder path reads as packd's sealed memfd.
//!
//! ONNX Runtime maps a model's external data from the file next to the model; it checks that
//! the file's path, and the path of the fd it opened (`readlink("/proc/self/fd/N")`), lie in
//! the model's folder. A served worker's folder holds a placeholder (an empty sparse file of
//! the data's size); while a [`StandIn`] lives, `open`, `open64` and `openat` of that exact
//! path from ONNX Runtime's library return a read-only fd of the memfd instead, and
//! `readlink` of that fd's `/proc/self/fd` entry answers the placeholder's path. Every other
//! call goes to libc unchanged.

use std::ffi::{CStr, CString, c_char, c_int};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use packd_interpose::scan::{Pinned, Slot, hook_object};

/// A placeholder path, the file it reads as, and the fds handed out for it (each sessions's
/// own: several sessions of one model in one process share the file's inode).
struct Stand {
    id: usize,
    path: CString,
    file: File,
    dev: u64,
    ino: u64,
    fds: Vec<c_int>,
}

/// The stand-ins in force; `ACTIVE` counts them, so that a hook with none returns to libc
/// without taking the lock. `OWNER`: the process that made them (a child forked meanwhile
/// inherits the table, and perhaps its lock held by a thread it does not have: its hooks
/// never touch it).
static TABLE: Mutex<Vec<Stand>> = Mutex::new(Vec::new());
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
static OWNER: AtomicU32 = AtomicU32::new(0);
static NEXT: AtomicUsize = AtomicUsize::new(1);

/// Whether this process has stand-ins in force.
fn active() -> bool {
    ACTIVE.load(Ordering::Acquire) > 0 && OWNER.load(Ordering::Acquire) == std::process::id()
}

/// While it lives, ONNX Runtime's opens of `path` open `file` (read-only) instead.
pub(crate) struct StandIn {
    id: usize,
}

impl StandIn {
    /// `path` (absolute, as ONNX Runtime will name it) reads as `file`.
    pub(crate) fn new(path: &Path, file: &File) -> io::Result<Self> {
        let path =
            CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let file = packd_interpose::sys::reopen_read_only(file)?;
        let meta = file.metadata()?;
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
        table.push(Stand { id, path, file, dev: meta.dev(), ino: meta.ino(), fds: Vec::new() });
        OWNER.store(std::process::id(), Ordering::Release);
        ACTIVE.store(table.len(), Ordering::Release);
        Ok(Self { id })
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
        table.retain(|s| s.id != self.id);
        ACTIVE.store(table.len(), Ordering::Release);
    }
}

/// A new read-only fd of the file `path` stands for, when it is a stand-in's path and the
/// open only reads. `Some(-1)` with errno set when the fd cannot be made.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
unsafe fn stand_for(path: *const c_char, flags: c_int) -> Option<c_int> {
    if !active() || path.is_null() || flags & libc::O_ACCMODE != libc::O_RDONLY {
        return None;
    }
    // SAFETY: a NUL-terminated string (the caller's promise).
    let path = unsafe { CStr::from_ptr(path) };
    let mut table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    let at = table.iter().position(|s| s.path.as_c_str() == path)?;
    // SAFETY: duplicates an fd the table owns; the new one is the caller's to close.
    let fd = unsafe { libc::fcntl(table[at].file.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if fd >= 0 {
        // The number is this stand-in's now (an earlier fd of that number was closed).
        for s in table.iter_mut() {
            s.fds.retain(|&f| f != fd);
        }
        table[at].fds.push(fd);
    }
    Some(fd)
}

/// The stand-in path of the fd that `/proc/self/fd/N` (or `/proc/PID/fd/N`, this process's
/// pid) names, when that fd is a stand-in's file.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string.
unsafe fn stand_in_path(path: *const c_char) -> Option<CString> {
    if !active() || path.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string (the caller's promise).
    let path = unsafe { CStr::from_ptr(path) }.to_bytes();
    let rest = path.strip_prefix(b"/proc/")?;
    let (who, fd) = rest.split_at(rest.iter().position(|&b| b == b'/')?);
    let me = std::process::id().to_string();
    if who != b"self" && who != me.as_bytes() {
        return None;
    }
    let fd: c_int = std::str::from_utf8(fd.strip_prefix(b"/fd/")?).ok()?.parse().ok()?;
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a `stat` into `st`; an fd that is not open fails with EBADF.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: fstat succeeded and filled it.
    let st = unsafe { st.assume_init() };
    let table = TABLE.lock().unwrap_or_else(|p| p.into_inner());
    // The stand-in that handed this fd out, while it is still that file.
    let stand = table.iter().find(|s| s.fds.contains(&fd) && s.dev == st.st_dev && s.ino == st.st_ino)?;
    Some(stand.path.clone())
}

unsafe extern "C" fn open_hook(path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    // SAFETY: ONNX Runtime passes open's arguments: a path string.
    if let Some(fd) = unsafe { stand_for(path, flags) } {
        return fd;
    }
    // SAFETY: open's own arguments, passed on (this object's `open` is libc's).
    unsafe { libc::open(path, flags, mode) }
}

unsafe extern "C" fn open64_hook(path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    // SAFETY: as `open_hook`.
    if let Some(fd) = unsafe { stand_for(path, flags) } {
        return fd;
    }
    // SAFETY: open64's own arguments, passed on.
    unsafe { libc::open64(path, flags, mode) }
}

unsafe extern "C" fn openat_hook(dir: c_int, path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    // Stand-in paths are absolute: `dir` plays no part for them.
    // SAFETY: as `open_hook`.
    if let Some(fd) = unsafe { stand_for(path, flags) } {
        return fd;
    }
    // SAFETY: openat's own arguments, passed on.
    unsafe { libc::openat(dir, path, flags, mode) }
}

unsafe extern "C" fn readlink_hook(path: *const c_char, buf: *mut c_char, len: usize) -> isize {
    // SAFETY: ONNX Runtime passes readlink's arguments: a path string.
    if let Some(target) = (!buf.is_null() && len > 0).then(|| unsafe { stand_in_path(path) }).flatten() {
        let bytes = target.as_bytes();
        let n = bytes.len().min(len);
        // SAFETY: `buf` has `len` writable bytes (readlink's contract); readlink writes no NUL.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), buf, n) };
        return n as isize;
    }
    // SAFETY: readlink's own arguments, passed on.
    unsafe { libc::readlink(path, buf, len) }
}

/// The slots to point at the hooks, each with libc's function as the one they replace.
fn slots() -> Vec<Slot> {
    let Some(program) = packd_interpose::sys::Loaded::program() else { return Vec::new() };
    let real = |name: &CStr| program.symbol(name).map_or(0, |p| p.as_ptr() as usize);
    let table: [(&'static str, &'static CStr, usize); 4] = [
        ("open", c"open", open_hook as unsafe extern "C" fn(*const c_char, c_int, libc::mode_t) -> c_int as usize),
        (
            "open64",
            c"open64",
            open64_hook as unsafe extern "C" fn(*const c_char, c_int, libc::mode_t) -> c_int as usize,
        ),
        (
            "openat",
            c"openat",
            openat_hook as unsafe extern "C" fn(c_int, *const c_char, c_int, libc::mode_t) -> c_int as usize,
        ),
        (
            "readlink",
            c"readlink",
            readlink_hook as unsafe extern "C" fn(*const c_char, *mut c_char, usize) -> isize as usize,
        ),
    ];
    table
        .into_iter()
        // SAFETY: each hook has the C signature of the symbol it is paired with (open's
        // variadic mode is read as the third argument, as the ABI passes it); the hooks live
        // in this library, which stays loaded while ONNX Runtime is.
        .map(|(symbol, name, hook)| unsafe { Slot::new(symbol, hook, real(name)) })
        .collect()
}

/// The symbols that name ONNX Runtime's library: its C API (`libonnxruntime.so`) or its
/// Python module (which links the runtime in and exports only its init).
const ENGINE_SYMBOLS: [&CStr; 2] = [c"OrtGetApiBase", c"PyInit_onnxruntime_pybind11_state"];

/// An object that is ONNX Runtime: its path, the address of the symbol that named it, and
/// how many of its slots now go through the hooks.
pub(crate) struct Engine {
    pub(crate) name: String,
    pub(crate) at: usize,
    pub(crate) hooked: usize,
}

/// Points ONNX Runtime's `open`, `open64`, `openat` and `readlink` slots at the hooks, in
/// every loaded object that is ONNX Runtime; empty when none is loaded.
pub(crate) fn hook_engine() -> Vec<Engine> {
    let me = own_address as fn() -> usize as usize;
    let slots = slots();
    let mut found = Vec::new();
    for object in packd_interpose::sys::objects() {
        if object.contains(me) || packd_interpose::scan::is_loader(&object) {
            continue;
        }
        let Some(pinned) = Pinned::pin(&object) else { continue };
        let Some(at) = ENGINE_SYMBOLS.iter().find_map(|s| pinned.defines(s)) else { continue };
        let hooked = if slots.is_empty() { 0 } else { hook_object(&pinned, &slots) };
        found.push(Engine { name: pinned.display_name(), at, hooked });
    }
    found
}

fn own_address() -> usize {
    own_address as fn() -> usize as usize
}

/// Watches `path` for being opened: ONNX Runtime must never read a placeholder itself (it
/// holds zeros). The watch ends when the value is dropped.
pub(crate) struct Watch {
    fd: OwnedFd,
}

impl Watch {
    pub(crate) fn new(path: &Path) -> io::Result<Self> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: plain syscall; the fd returned is owned below.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened and is owned here alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `c` is a NUL-terminated path.
        if unsafe { libc::inotify_add_watch(fd.as_raw_fd(), c.as_ptr(), libc::IN_OPEN | libc::IN_ACCESS) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd })
    }

    /// Whether the file was opened or read since the watch began.
    pub(crate) fn touched(&self) -> bool {
        let mut buf = [0u8; 4096];
        // SAFETY: reads into a buffer of its length; the fd is non-blocking.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        n > 0
    }
}

/// Gives the heap's free memory back to the system (glibc's `malloc_trim`).
pub(crate) fn trim_heap() {
    // SAFETY: malloc_trim only returns free memory; it takes no pointer.
    unsafe { libc::malloc_trim(0) };
}

/// `file`'s bytes, mapped read-only: the model is walked without reading the weights it holds
/// (their pages are never touched).
pub(crate) fn map_model(file: &File) -> io::Result<memmap2::Mmap> {
    // SAFETY: a shared read-only mapping, read only through the slice it derefs to. The file
    // is the user's: written meanwhile, the walk sees other bytes (it checks every length, and
    // the identity names the digest packd took of the same open file); truncated meanwhile,
    // a read past its new end stops the process with SIGBUS — as ONNX Runtime's own mapping
    // of a model's external data would.
    unsafe { memmap2::MmapOptions::new().map(file) }
}
