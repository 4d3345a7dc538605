//! Weights llama.cpp puts in an extra buffer type packd does not share (ggml's `AMX` on
//! Intel CPUs with AMX, `CPU_KLEIDIAI` on Arm, any other): each converts the weights into
//! private memory in every process. packd leaves them as they are, but never silently: the
//! buffer is counted by buffer type, its tensors by ggml type (its `init_tensor` is wrapped
//! to see them), and packd is told (fallback `unshared_buffer_type`).
//!
//! A buffer type is "extra" when the CPU device lists it among its extra buffer types
//! (`ggml_backend_dev_get_extra_bufts`, found as llama.cpp finds it, through the device's
//! registry); `CPU_REPACK` is one, and packd shares it (`crate::repack`).

use std::collections::HashMap;
use std::ffi::{CStr, c_void};
use std::sync::{Mutex, OnceLock};

use super::ggml::{
    Buffer, BufferIface, BufferIface09, BufferPtr, BufferTypePtr, BuftDeviceFn, DevRegFn, Fns, Iface, InitFn, Layout,
    NbytesFn, ProcAddressFn, TensorPtr, TypeNameFn,
};
use super::handler::HANDLER;

/// What this module needs of the running ggml (found before any slot was written).
#[derive(Clone, Copy)]
pub(crate) struct Ggml {
    /// The buffer layout of the running version.
    pub layout: Layout,
    /// `ggml_backend_buft_get_device`, `ggml_backend_dev_backend_reg`,
    /// `ggml_backend_reg_get_proc_address`.
    pub devices: Option<(BuftDeviceFn, DevRegFn, ProcAddressFn)>,
    /// `ggml_nbytes`.
    pub nbytes: NbytesFn,
    /// `ggml_type_name`.
    pub type_name: TypeNameFn,
}

/// The ggml the tensors are counted with (set by the first [`watch`] of an extra buffer).
static GGML: OnceLock<Ggml> = OnceLock::new();

/// `ggml_backend_dev_get_extra_bufts_t`: a NULL-terminated array of buffer types.
type ExtraBuftsFn = unsafe extern "C" fn(*mut c_void) -> *mut BufferTypePtr;

/// The extra buffers seen: buffer address → (its own `init_tensor`, its type's name).
type Seen = HashMap<usize, (Option<InitFn>, String)>;
static EXTRA: OnceLock<Mutex<Seen>> = OnceLock::new();

fn extra() -> std::sync::MutexGuard<'static, Seen> {
    EXTRA.get_or_init(Mutex::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether `buft` is one of its device's extra buffer types.
///
/// # Safety
/// `buft` must be a live buffer type (ggml just allocated a buffer of it).
unsafe fn is_extra(reals: &Ggml, buft: BufferTypePtr) -> bool {
    let Some((buft_device, dev_reg, proc_address)) = reals.devices else { return false };
    // SAFETY: ggml's accessors on a live buffer type and the device and registry it names
    // (each may be NULL, checked); the proc address is looked up by ggml's own name, and
    // has the signature ggml-backend.h gives `ggml_backend_dev_get_extra_bufts_t`; its
    // NULL-terminated list is read up to the terminator (at most 64 entries).
    unsafe {
        let dev = buft_device(buft);
        if dev.is_null() {
            return false;
        }
        let reg = dev_reg(dev);
        if reg.is_null() {
            return false;
        }
        let f = proc_address(reg, c"ggml_backend_dev_get_extra_bufts".as_ptr());
        if f.is_null() {
            return false;
        }
        let f: ExtraBuftsFn = std::mem::transmute::<*mut c_void, ExtraBuftsFn>(f);
        let mut p = f(dev);
        // At most 64 entries are read: the lists ggml makes hold a few.
        for _ in 0..64 {
            if p.is_null() || (*p).is_null() {
                return false;
            }
            if *p == buft {
                return true;
            }
            p = p.add(1);
        }
        false
    }
}

/// Looks at a buffer ggml just allocated of type `buft` named `name` (not `CPU_REPACK`): an
/// extra buffer type's is counted, and its tensors will be.
///
/// # Safety
/// `buffer` must be the live buffer ggml just allocated for `buft`, laid out as `reals`'s
/// layout says, seen by nobody else yet; `reals` the running ggml's functions.
pub(crate) unsafe fn watch(reals: &Ggml, buffer: BufferPtr, buft: BufferTypePtr, name: &str, size: usize) {
    // SAFETY: the caller's promise.
    if !unsafe { is_extra(reals, buft) } {
        return;
    }
    // SAFETY: the caller's promise, passed on.
    let orig = unsafe {
        match reals.layout {
            Layout::Ggml09 => wrap::<BufferIface09>(buffer),
            Layout::Ggml013 => wrap::<BufferIface>(buffer),
        }
    };
    let _ = GGML.set(*reals);
    extra().insert(buffer as usize, (orig, name.to_string()));
    if let Some(h) = HANDLER.get() {
        h.unshared(name, size);
    }
}

/// Puts [`init_hook`] in the buffer's table; returns the buffer's own `init_tensor`.
///
/// # Safety
/// As [`watch`]'s, with `I` the running layout.
unsafe fn wrap<I: Iface>(buffer: BufferPtr) -> Option<InitFn> {
    let typed = buffer.cast::<Buffer<I>>();
    // SAFETY: the caller's promise: a live Buffer<I>, ours alone for now; the only reference.
    let b = unsafe { &mut *typed };
    let fns = b.iface.fns();
    b.iface.set_fns(&Fns { init_tensor: Some(init_hook), ..fns });
    fns.init_tensor
}

/// An extra buffer's `init_tensor`: counts the tensor, then runs the buffer's own.
unsafe extern "C" fn init_hook(buffer: BufferPtr, tensor: TensorPtr) -> i32 {
    let Some((orig, buft)) = extra().get(&(buffer as usize)).cloned() else {
        // Never seen: every buffer with this hook is in the map, and stays there.
        return 0;
    };
    if let Some(reals) = GGML.get() {
        // SAFETY: a live tensor ggml is placing in this buffer (its plain fields read).
        let t = unsafe { &*tensor };
        if t.view_src.is_null() {
            // SAFETY: ggml's functions on the live tensor and its type (below
            // GGML_TYPE_COUNT); ggml_type_name returns a static string or NULL.
            let (bytes, name) = unsafe { ((reals.nbytes)(tensor), (reals.type_name)(t.type_)) };
            let ty = if name.is_null() {
                format!("type {}", t.type_)
            } else {
                // SAFETY: a NUL-terminated static string (checked for NULL).
                unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
            };
            if let Some(h) = HANDLER.get() {
                h.unshared_tensor(&buft, &ty, bytes);
            }
        }
    }
    match orig {
        // SAFETY: the buffer's own init_tensor with ggml's arguments.
        Some(f) => unsafe { f(buffer, tensor) },
        None => 0,
    }
}
