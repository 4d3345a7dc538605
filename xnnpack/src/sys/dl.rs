//! Libraries already loaded in this process: held open by handle (`dlopen` with
//! `RTLD_NOLOAD`), their exported symbols, and XNNPACK's build identifier read through them.

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

    pub(crate) fn has(&self, name: &std::ffi::CStr) -> bool {
        self.symbol(name).is_some()
    }

    /// XNNPACK's own build identifier (a digest of its micro-kernels' sources, 32 bytes),
    /// as a BLAKE3 prefix, from `xnn_experimental_get_build_identifier_data`/`_size` —
    /// `None` when the library does not export them (XNNPACK before 2024-05).
    pub(crate) fn xnn_build_identifier(&self) -> Option<String> {
        let data = self.symbol(c"xnn_experimental_get_build_identifier_data")?;
        let size = self.symbol(c"xnn_experimental_get_build_identifier_size")?;
        // SAFETY: XNNPACK declares it, since 2024-05, as `const void* (void)`
        // (examples/xnnpack/current/xnnpack.h); the exported symbol of that name is it.
        let data: unsafe extern "C" fn() -> *const u8 = unsafe { std::mem::transmute(data.as_ptr()) };
        // SAFETY: as above, declared `size_t (void)`.
        let size: unsafe extern "C" fn() -> usize = unsafe { std::mem::transmute(size.as_ptr()) };
        // SAFETY: both take nothing and only return a static array's address and length.
        let (p, n) = unsafe { (data(), size()) };
        if p.is_null() || n == 0 || n > 256 {
            return None;
        }
        // SAFETY: the functions return a static array and its length (bounded above), valid
        // while the library is loaded: self holds it.
        let id = unsafe { std::slice::from_raw_parts(p, n) };
        Some(blake3::hash(id).to_hex()[..32].to_string())
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        // SAFETY: the handle dlopen returned, closed once; no symbol of it is used after.
        unsafe { libc::dlclose(self.0.as_ptr()) };
    }
}
