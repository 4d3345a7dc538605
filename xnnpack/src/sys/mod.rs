//! Where this crate's `unsafe` lives (with the provider's own block handling in `cache`):
//! the functions put in the engine's GOT slots ([`hooks`]), the provider XNNPACK calls back
//! ([`provider`]), and XNNPACK's build identifier read through its exports. Nothing here
//! imports the rest of the crate: hooks call the handler `crate::adopt` registered, and the
//! provider's callbacks the cache it was made with.

pub(crate) mod hooks;
pub(crate) mod provider;

use packd_interpose::sys::Loaded;

/// XNNPACK's own build identifier (a digest of its micro-kernels' sources, 32 bytes), as a
/// BLAKE3 prefix, from `xnn_experimental_get_build_identifier_data`/`_size` — `None` when
/// the library does not export them (XNNPACK before 2024-05).
pub(crate) fn build_identifier(lib: &Loaded) -> Option<String> {
    let data = lib.symbol(c"xnn_experimental_get_build_identifier_data")?;
    let size = lib.symbol(c"xnn_experimental_get_build_identifier_size")?;
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
    // while the library is loaded: `lib` holds it.
    let id = unsafe { std::slice::from_raw_parts(p, n) };
    Some(blake3::hash(id).to_hex()[..32].to_string())
}
