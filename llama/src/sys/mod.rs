//! Where this crate's `unsafe` lives: the functions put in llama.cpp's GOT slots and in the
//! `CPU_REPACK` buffers' function tables ([`hooks`]), which read ggml's structures and map
//! packd's segments under the buffers.

pub(crate) mod hooks;

/// The loaded object holding the code at `addr` (a return address), held open: `None` for
/// 0 or an address in no object. The program itself, whose path the loader does not open
/// by name, is given as the program's handle (the global scope).
pub(crate) fn caller_object(addr: usize) -> Option<packd_xnnpack::shared::Loaded> {
    if addr == 0 {
        return None;
    }
    // SAFETY: an all-zero Dl_info is valid (null pointers), and dladdr only writes it.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr takes any address and fills `info` (returns 0 when no object holds it).
    if unsafe { libc::dladdr(addr as *const std::ffi::c_void, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is the loader's NUL-terminated name of the object, alive while it
    // stays loaded (it holds the code that called us, so it is).
    let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) }.to_str().ok()?;
    packd_xnnpack::shared::Loaded::open(name).or_else(packd_xnnpack::shared::Loaded::program)
}
