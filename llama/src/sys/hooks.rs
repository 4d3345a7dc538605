//! The hooks. `ggml_backend_buft_alloc_buffer` is replaced in the GOT slots of the objects
//! that call it; for a buffer of the type named `CPU_REPACK` (llama.cpp's repacked weights)
//! the real function allocates it as ever, then the buffer's memory is swapped for a
//! [`Backing`] of packd's and five entries of its function table for these hooks:
//! `init_tensor`, `set_tensor`, `memset_tensor`, `clear` and `free_buffer`.
//!
//! Each hook reads what ggml handed it (the buffer, a tensor laid out as `ggml` declares for
//! the version found before any slot was written) and asks the [`Handler`] the adapter
//! registered (`crate::repack`) what to do; ggml's own function runs where the handler
//! says, through a closure. Nothing here decides anything or imports the rest of the crate.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use packd_interpose::say;
use packd_interpose::scan::Pinned;
use packd_interpose::sys::page;

use super::buffer::Backing;
use super::ggml::{
    Buffer, BufferIface, BufferIface09, BufferPtr, BufferTypePtr, BuftDeviceFn, DevRegFn, Fns, Iface, Layout, MAX_NAME,
    NbytesFn, ProcAddressFn, TensorPtr, TypeNameFn,
};
use super::handler::{AdoptError, HANDLER, Handler, TensorInfo, Write};

/// `ggml_backend_buft_alloc_buffer`.
pub(crate) type AllocFn = unsafe extern "C" fn(BufferTypePtr, usize) -> BufferPtr;
/// `ggml_backend_buft_name`.
pub(crate) type NameFn = unsafe extern "C" fn(BufferTypePtr) -> *const c_char;

/// ggml's functions packd calls, set once (for a supported ggml) before any slot points at
/// a hook.
pub(crate) struct Reals {
    pub buft_name: NameFn,
    pub nbytes: NbytesFn,
    pub type_name: TypeNameFn,
    /// `ggml_backend_buft_get_device`, `ggml_backend_dev_backend_reg` and
    /// `ggml_backend_reg_get_proc_address` (to tell the extra buffer types, `sys::unshared`).
    pub devices: Option<(BuftDeviceFn, DevRegFn, ProcAddressFn)>,
    /// The running version's buffer layout.
    pub layout: Layout,
}

pub(crate) static REALS: OnceLock<Reals> = OnceLock::new();

/// A buffer whose function table and memory were swapped: what ggml made, to call and to
/// give back.
struct Swapped {
    orig: Fns,
    orig_context: usize,
    /// The memory under it, kept until ggml's own free has run.
    backing: Arc<Backing>,
}

static BUFFERS: OnceLock<Mutex<HashMap<usize, Swapped>>> = OnceLock::new();

fn buffers() -> MutexGuard<'static, HashMap<usize, Swapped>> {
    BUFFERS.get_or_init(Mutex::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The functions ggml gave `buffer`, and the memory under it.
fn swapped_of(buffer: BufferPtr) -> (Fns, Arc<Backing>) {
    let all = buffers();
    let s = all.get(&(buffer as usize)).unwrap_or_else(|| fatal("a buffer packd does not know"));
    (s.orig, Arc::clone(&s.backing))
}

/// Ends the process with a message: ggml asked something of a served buffer that cannot be
/// answered without giving it wrong weights (never seen with the supported llama.cpp).
pub(crate) fn fatal(what: &str) -> ! {
    say!("packd-llama: {what}; stopping rather than computing with wrong weights");
    std::process::abort();
}

fn handler() -> &'static dyn Handler {
    HANDLER.get().unwrap_or_else(|| fatal("a hook ran before packd-llama registered its handler"))
}

/// ggml's own `ggml_backend_buft_alloc_buffer`, found whether or not packd acts (the
/// interposed definition below must forward every call).
pub(crate) static REAL_ALLOC: OnceLock<AllocFn> = OnceLock::new();

/// ggml's own `ggml_backend_buft_alloc_buffer` in `lib`.
pub(crate) fn alloc_of(lib: &Pinned) -> Option<AllocFn> {
    let at = lib.defines(c"ggml_backend_buft_alloc_buffer")?;
    // SAFETY: the definition of ggml_backend_buft_alloc_buffer in the library defining
    // ggml's API (ggml-backend.h's signature).
    Some(unsafe { std::mem::transmute::<usize, AllocFn>(at) })
}

/// ggml's own `ggml_backend_buft_alloc_buffer`: the one loaded object other than this
/// library that defines it (for a process where packd is turned off, whose allocations
/// still come through this library's exported definition).
pub(crate) fn find_real_alloc() -> Option<AllocFn> {
    let me = alloc_hook_address();
    let found: Vec<AllocFn> = packd_interpose::sys::objects()
        .iter()
        .filter(|o| !o.contains(me))
        .filter_map(Pinned::pin)
        .filter_map(|p| alloc_of(&p))
        .collect();
    match found.as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

/// The address of [`ggml_backend_buft_alloc_buffer`], for the GOT slots.
pub(crate) fn alloc_hook_address() -> usize {
    ggml_backend_buft_alloc_buffer as AllocFn as usize
}

/// `ggml_backend_buft_alloc_buffer` as the hooked objects call it. Exported under ggml's
/// name, so that with `LD_PRELOAD` a llama.cpp loaded later (`dlopen`, as Python's ctypes
/// loads it, even `RTLD_LOCAL`) binds its calls here too; GOT slots of objects loaded before
/// are rewritten to it by the scan. Without a supported ggml it only forwards.
///
/// # Safety
/// As ggml's function: `buft` is a live buffer type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ggml_backend_buft_alloc_buffer(buft: BufferTypePtr, size: usize) -> BufferPtr {
    let real = match REAL_ALLOC.get() {
        Some(f) => *f,
        None => {
            // The first call of a llama.cpp loaded after start: find it now (with packd
            // turned off no handler is registered: ggml's own function is found alone).
            match HANDLER.get() {
                Some(h) => h.scan(),
                None => {
                    if let Some(f) = find_real_alloc() {
                        let _ = REAL_ALLOC.set(f);
                    }
                }
            }
            *REAL_ALLOC.get().unwrap_or_else(|| fatal("cannot find ggml's own ggml_backend_buft_alloc_buffer"))
        }
    };
    // SAFETY: ggml's function with the caller's own arguments.
    let buffer = unsafe { real(buft, size) };
    if REALS.get().is_none()
        && let Some(h) = HANDLER.get()
        && h.waits_for_cpu_backend()
    {
        // The release layout: the CPU backend may have been loaded since the last scan.
        h.scan();
    }
    let Some(reals) = REALS.get() else { return buffer }; // not acting: as without packd
    if buffer.is_null() || size < page() {
        return buffer; // the 0-byte probes llama.cpp makes, and failures, pass through
    }
    // SAFETY: ggml_backend_buft_name takes any buffer type and returns a static string.
    let name = unsafe { (reals.buft_name)(buft) };
    if name.is_null() {
        return buffer;
    }
    // SAFETY: a NUL-terminated string ggml owns for the buffer type's lifetime.
    let name = unsafe { CStr::from_ptr(name) };
    if name.to_bytes() != b"CPU_REPACK" {
        let ggml = super::unshared::Ggml {
            layout: reals.layout,
            devices: reals.devices,
            nbytes: reals.nbytes,
            type_name: reals.type_name,
        };
        // SAFETY: the live buffer just allocated for `buft`, laid out as the running
        // version's table entry says, not yet seen by our caller; ggml's own functions.
        unsafe { super::unshared::watch(&ggml, buffer, buft, &name.to_string_lossy(), size) };
        return buffer;
    }
    // SAFETY: `buffer` is the live buffer just allocated, owned by our caller, which has
    // not seen it yet: nothing else reads or writes it meanwhile; laid out as the running
    // version's table entry says (checked before REALS was set).
    let adopted = unsafe {
        match reals.layout {
            Layout::Ggml09 => adopt::<BufferIface09>(buffer, buft, size),
            Layout::Ggml013 => adopt::<BufferIface>(buffer, buft, size),
        }
    };
    if let Err(why) = adopted {
        handler().not_adopted(size, why);
    }
    buffer
}

/// Puts packd's memory and hooks in a fresh `CPU_REPACK` buffer, whose function table is an
/// `I`, and tells the handler.
///
/// # Safety
/// `buffer` must be the live buffer ggml just allocated for `buft`, a `Buffer<I>`, seen by
/// nobody else yet.
unsafe fn adopt<I: Iface>(buffer: BufferPtr, buft: BufferTypePtr, size: usize) -> Result<(), AdoptError> {
    let typed = buffer as *mut Buffer<I>;
    // SAFETY: the caller's promise: a live Buffer<I>, ours alone for now (read by value).
    let iface = unsafe { (*typed).iface }.fns();
    let (Some(get_base), Some(_), Some(_), Some(_)) =
        (iface.get_base, iface.init_tensor, iface.set_tensor, iface.free_buffer)
    else {
        return Err(AdoptError::MissingFunction);
    };
    // SAFETY: as above (read by value).
    if unsafe { (*typed).iface }.other_writer() {
        return Err(AdoptError::OtherWriter);
    }
    // SAFETY: the buffer's own get_base on the buffer (no reference into it is held).
    let base = unsafe { get_base(buffer) } as usize;
    // SAFETY: the caller's promise: a live Buffer<I>, ours alone for now; the only reference.
    let b = unsafe { &mut *typed };
    if b.buft != buft || b.size != size || base != b.context as usize {
        return Err(AdoptError::Layout);
    }
    let len = size.next_multiple_of(page());
    let backing = Arc::new(Backing::new(len).map_err(|source| AdoptError::Reserve { len, source })?);
    let orig_context = b.context as usize;
    b.context = backing.base() as *mut c_void;
    b.iface.set_fns(&Fns {
        init_tensor: Some(init_hook),
        set_tensor: Some(set_hook),
        memset_tensor: Some(memset_hook),
        clear: Some(clear_hook),
        free_buffer: Some(free_hook::<I>),
        ..iface
    });
    buffers().insert(buffer as usize, Swapped { orig: iface, orig_context, backing: Arc::clone(&backing) });
    handler().adopted(buffer as usize, backing, size);
    Ok(())
}

/// Reads what the layout needs of a tensor.
///
/// # Safety
/// `tensor` must be a live tensor ggml passed to a hook.
unsafe fn tensor_info(tensor: TensorPtr, base: usize) -> TensorInfo {
    // SAFETY: the caller's promise.
    let t = unsafe { &*tensor };
    let name = &t.name[..t.name.iter().position(|&c| c == 0).unwrap_or(MAX_NAME)];
    let nbytes = REALS.get().map_or(0, |r| {
        // SAFETY: ggml_nbytes reads the live tensor's type, shape and strides.
        unsafe { (r.nbytes)(tensor) }
    });
    TensorInfo {
        name: String::from_utf8_lossy(name).into_owned(),
        type_: t.type_,
        ne: t.ne,
        nb: t.nb,
        offset: (t.data as usize).wrapping_sub(base),
        nbytes,
    }
}

/// The name ggml gives type `ty` (`q4_0`, …), from a live tensor's type.
pub(crate) fn type_name(ty: i32) -> String {
    let Some(reals) = REALS.get() else { return format!("type {ty}") };
    // SAFETY: the type of a live tensor ggml made (so below GGML_TYPE_COUNT, which
    // ggml_type_name indexes its table with); it returns a static string.
    let name = unsafe { (reals.type_name)(ty) };
    if name.is_null() {
        return format!("type {ty}");
    }
    // SAFETY: a NUL-terminated static string (checked for NULL).
    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
}

unsafe extern "C" fn init_hook(buffer: BufferPtr, tensor: TensorPtr) -> i32 {
    let (orig, base) = {
        let all = buffers();
        let s = all.get(&(buffer as usize)).unwrap_or_else(|| fatal("init_tensor on a buffer packd does not know"));
        (s.orig, s.backing.base())
    };
    // SAFETY: a live tensor ggml is placing in this buffer.
    let info = unsafe { tensor_info(tensor, base) };
    // SAFETY: as above; view_src is a plain field.
    let view = !unsafe { &*tensor }.view_src.is_null();
    handler().placed(buffer as usize, tensor as usize, info, view);
    let init = orig.init_tensor.unwrap_or_else(|| fatal("the buffer lost its init_tensor"));
    // SAFETY: repack's own init_tensor with ggml's arguments.
    unsafe { init(buffer, tensor) }
}

unsafe extern "C" fn set_hook(buffer: BufferPtr, tensor: TensorPtr, data: *const c_void, offset: usize, size: usize) {
    let (orig, backing) = swapped_of(buffer);
    let set = orig.set_tensor.unwrap_or_else(|| fatal("the buffer lost its set_tensor"));
    let mut repack = || {
        if !backing.writable() {
            fatal("a CPU_REPACK buffer would be written where its memory is not writable");
        }
        // SAFETY: repack's own set_tensor with ggml's arguments, on the buffer's memory,
        // backed writable (checked just now).
        unsafe { set(buffer, tensor, data, offset, size) }
    };
    let write = Write { tensor: tensor as usize, data: data as usize, offset, size };
    handler().set(buffer as usize, write, &mut repack);
}

unsafe extern "C" fn memset_hook(buffer: BufferPtr, tensor: TensorPtr, value: u8, offset: usize, size: usize) {
    let (orig, backing) = swapped_of(buffer);
    let f = orig.memset_tensor.unwrap_or_else(|| fatal("the buffer has no memset_tensor"));
    let mut memset = || {
        if !backing.writable() {
            fatal("memset_tensor where the buffer's memory is not writable");
        }
        // SAFETY: the CPU buffer's memset_tensor with ggml's arguments, on the buffer's
        // memory, backed writable (checked just now).
        unsafe { f(buffer, tensor, value, offset, size) }
    };
    handler().memset(buffer as usize, &mut memset);
}

unsafe extern "C" fn clear_hook(buffer: BufferPtr, value: u8) {
    handler().clear(buffer as usize, value);
}

unsafe extern "C" fn free_hook<I: Iface>(buffer: BufferPtr) {
    let keep = handler().freed(buffer as usize);
    let Some(swapped) = buffers().remove(&(buffer as usize)) else { fatal("free on a buffer packd does not know") };
    // SAFETY: `buffer` is the live Buffer<I> ggml frees now (`adopt::<I>` put this hook in
    // it); it gets back the memory and the free function ggml gave it, and frees as ggml
    // would.
    unsafe {
        let b = &mut *(buffer as *mut Buffer<I>);
        b.context = swapped.orig_context as *mut c_void;
        let mut fns = b.iface.fns();
        fns.free_buffer = swapped.orig.free_buffer;
        b.iface.set_fns(&fns);
        if let Some(f) = swapped.orig.free_buffer {
            f(buffer);
        }
    }
    // The memory goes now (ggml holds no pointer into it any more), then the served
    // segment's lease.
    drop(swapped);
    drop(keep);
}
