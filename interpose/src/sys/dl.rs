//! Libraries already loaded in this process: held open by handle (`dlopen` with
//! `RTLD_NOLOAD`), and their exported symbols.

/// A library already loaded in this process, held open (`dlopen` with `RTLD_NOLOAD`, so
/// nothing is loaded and no constructor runs) until dropped.
pub struct Loaded(std::ptr::NonNull<std::ffi::c_void>);

impl Loaded {
    pub fn open(path: &str) -> Option<Self> {
        let path = std::ffi::CString::new(path).ok()?;
        // SAFETY: RTLD_NOLOAD only looks up a library already loaded; the handle it returns
        // (if any) takes a reference that Drop gives back.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        std::ptr::NonNull::new(handle).map(Self)
    }

    /// The program itself (its global scope: it and the libraries loaded with it).
    pub fn program() -> Option<Self> {
        // SAFETY: dlopen(NULL) returns the program's handle, referenced until Drop.
        std::ptr::NonNull::new(unsafe { libc::dlopen(std::ptr::null(), libc::RTLD_LAZY) }).map(Self)
    }

    /// The address of the library's symbol `name`, if it exports it.
    pub fn symbol(&self, name: &std::ffi::CStr) -> Option<std::ptr::NonNull<std::ffi::c_void>> {
        // SAFETY: a live handle (held by self) and a NUL-terminated name.
        std::ptr::NonNull::new(unsafe { libc::dlsym(self.0.as_ptr(), name.as_ptr()) })
    }

    pub fn has(&self, name: &std::ffi::CStr) -> bool {
        self.symbol(name).is_some()
    }
}

/// Puts the loaded library at `path` in the process's global scope (`dlopen` with
/// `RTLD_NOLOAD | RTLD_GLOBAL`) for good: a library loaded later binds its undefined symbols
/// to this one's definitions before its own dependencies'. For an interposing library loaded
/// with `dlopen(RTLD_LOCAL)` (Python's ctypes default), so that it acts as with
/// `LD_PRELOAD` on what is loaded after it; never unloaded from then on (`RTLD_NODELETE`).
/// Whether it is in the global scope now.
pub fn keep_global(path: &str) -> bool {
    let Ok(path) = std::ffi::CString::new(path) else { return false };
    let flags = libc::RTLD_LAZY | libc::RTLD_NOLOAD | libc::RTLD_GLOBAL | libc::RTLD_NODELETE;
    // SAFETY: RTLD_NOLOAD only looks up a library already loaded (nothing is loaded, no
    // constructor runs) and adds it to the global scope; the reference taken is never given
    // back, so the library stays loaded (its functions are in other objects' GOT slots).
    let handle = unsafe { libc::dlopen(path.as_ptr(), flags) };
    !handle.is_null()
}

impl Drop for Loaded {
    fn drop(&mut self) {
        // SAFETY: the handle dlopen returned, closed once; no symbol of it is used after.
        unsafe { libc::dlclose(self.0.as_ptr()) };
    }
}
