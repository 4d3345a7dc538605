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

impl Drop for Loaded {
    fn drop(&mut self) {
        // SAFETY: the handle dlopen returned, closed once; no symbol of it is used after.
        unsafe { libc::dlclose(self.0.as_ptr()) };
    }
}
