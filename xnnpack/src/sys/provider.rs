//! The weights-cache provider XNNPACK calls back: its C layout, the key it passes, read for
//! the engine's interface, and the callbacks, which answer through the [`WeightsCache`] a
//! provider was made with (`crate::cache::XnnCache`).

use std::ffi::{c_int, c_void};

/// XNNPACK's look-up key (`struct xnn_weights_cache_look_up_key`) as the provider reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct XnnKey {
    /// The seed: a hash of the operator's type and packing parameters.
    pub seed: u32,
    /// The kernel's address in this process (0: none).
    pub kernel: usize,
    /// The bias's address in this process (0: none, or not given, as for qd8 nodes).
    pub bias: usize,
    /// The fingerprint id of XNNPACK's current interface (Nov 2025); `None` with the
    /// 2024-11 interface, whose key has no such field.
    pub fingerprint: Option<u32>,
}

/// `enum xnn_status` values used here and by the hooks.
pub(crate) const XNN_SUCCESS: c_int = 0;
pub(crate) const XNN_INVALID_PARAMETER: c_int = 2;

/// XNNPACK's "not found" offset.
pub const NOT_FOUND: usize = usize::MAX;

/// What the provider's callbacks ask of a weights cache.
pub(crate) trait WeightsCache: Sync {
    /// The offset of the weights filed under `key`, or [`NOT_FOUND`].
    fn look_up(&self, key: &XnnKey) -> usize;
    /// The address of `n` bytes XNNPACK packs into next.
    fn reserve_space(&self, n: usize) -> usize;
    /// Files the `size` bytes at `ptr` under `key` (or finds them filed); their offset.
    fn look_up_or_insert(&self, key: &XnnKey, ptr: usize, size: usize) -> usize;
    /// The address of `offset`.
    fn offset_to_addr(&self, offset: usize) -> usize;
    /// Whether `alias` may stand for the weights at `original`.
    fn alias_data(&self, alias: usize, original: usize) -> bool;
}

/// The callbacks' context: the cache and the key layout of the engine's interface.
pub(crate) struct Ctx<C> {
    pub cache: C,
    pub interface: u32,
}

/// `struct xnn_weights_cache_provider` as the current interface lays it out (the 2024-11
/// one is its first seven members; XNNPACK does not read past them).
#[repr(C)]
pub(crate) struct Provider {
    context: *const c_void,
    look_up: unsafe extern "C" fn(*const c_void, *const u8) -> usize,
    reserve_space: unsafe extern "C" fn(*const c_void, usize) -> *mut c_void,
    look_up_or_insert: unsafe extern "C" fn(*const c_void, *const u8, *mut c_void, usize) -> usize,
    is_finalized: unsafe extern "C" fn(*const c_void) -> bool,
    offset_to_addr: unsafe extern "C" fn(*const c_void, usize) -> *mut c_void,
    delete_cache: unsafe extern "C" fn(*const c_void) -> c_int,
    alias_data: unsafe extern "C" fn(*const c_void, *mut c_void, *mut c_void) -> c_int,
}

// SAFETY: the provider only holds a pointer to a `Ctx<C>` (Sync: `WeightsCache` is) that
// outlives it, and function pointers.
unsafe impl Send for Provider {}
// SAFETY: as above; nothing in it is written after creation.
unsafe impl Sync for Provider {}

impl Provider {
    /// A provider whose callbacks use `ctx`, which must not move or go while XNNPACK holds
    /// the provider (both are boxed and dropped together, after the runtime).
    pub(crate) fn new<C: WeightsCache>(ctx: &Ctx<C>) -> Self {
        Self {
            context: std::ptr::from_ref(ctx).cast(),
            look_up: cb_look_up::<C>,
            reserve_space: cb_reserve_space::<C>,
            look_up_or_insert: cb_look_up_or_insert::<C>,
            is_finalized: cb_is_finalized,
            offset_to_addr: cb_offset_to_addr::<C>,
            delete_cache: cb_delete_cache,
            alias_data: cb_alias_data::<C>,
        }
    }
}

/// The look-up key XNNPACK passes, read for the engine's interface: `{u32 seed; const void*
/// kernel; const void* bias}` and, from 2025-11, `u32 fingerprint_id` after them.
///
/// # Safety
/// `key` points at the engine's `struct xnn_weights_cache_look_up_key`.
unsafe fn read_key<C>(ctx: &Ctx<C>, key: *const u8) -> Option<XnnKey> {
    if key.is_null() {
        return None;
    }
    let w = std::mem::size_of::<usize>();
    // SAFETY: the key's fields at the offsets its layout gives (packd_xnnpack.h asserts them
    // for C; the interface was told from the engine's exported symbols).
    unsafe {
        Some(XnnKey {
            seed: key.cast::<u32>().read_unaligned(),
            kernel: key.add(w).cast::<usize>().read_unaligned(),
            bias: key.add(2 * w).cast::<usize>().read_unaligned(),
            fingerprint: (ctx.interface >= 202_511).then(|| key.add(3 * w).cast::<u32>().read_unaligned()),
        })
    }
}

unsafe extern "C" fn cb_look_up<C: WeightsCache>(ctx: *const c_void, key: *const u8) -> usize {
    // SAFETY: the `Ctx<C>` this provider was made with (`Provider::new::<C>` paired this
    // callback with it), alive while XNNPACK holds it.
    let ctx = unsafe { &*ctx.cast::<Ctx<C>>() };
    // SAFETY: XNNPACK passes its key.
    match unsafe { read_key(ctx, key) } {
        Some(k) => ctx.cache.look_up(&k),
        None => NOT_FOUND,
    }
}

unsafe extern "C" fn cb_reserve_space<C: WeightsCache>(ctx: *const c_void, n: usize) -> *mut c_void {
    // SAFETY: as in cb_look_up.
    unsafe { &*ctx.cast::<Ctx<C>>() }.cache.reserve_space(n) as *mut c_void
}

unsafe extern "C" fn cb_look_up_or_insert<C: WeightsCache>(
    ctx: *const c_void,
    key: *const u8,
    ptr: *mut c_void,
    size: usize,
) -> usize {
    // SAFETY: as in cb_look_up.
    let ctx = unsafe { &*ctx.cast::<Ctx<C>>() };
    // SAFETY: XNNPACK passes its key.
    match unsafe { read_key(ctx, key) } {
        Some(k) => ctx.cache.look_up_or_insert(&k, ptr as usize, size),
        None => NOT_FOUND,
    }
}

unsafe extern "C" fn cb_is_finalized(_ctx: *const c_void) -> bool {
    true
}

unsafe extern "C" fn cb_offset_to_addr<C: WeightsCache>(ctx: *const c_void, offset: usize) -> *mut c_void {
    // SAFETY: as in cb_look_up.
    unsafe { &*ctx.cast::<Ctx<C>>() }.cache.offset_to_addr(offset) as *mut c_void
}

unsafe extern "C" fn cb_delete_cache(_ctx: *const c_void) -> c_int {
    XNN_SUCCESS
}

unsafe extern "C" fn cb_alias_data<C: WeightsCache>(
    ctx: *const c_void,
    alias: *mut c_void,
    original: *mut c_void,
) -> c_int {
    // SAFETY: as in cb_look_up.
    if unsafe { &*ctx.cast::<Ctx<C>>() }.cache.alias_data(alias as usize, original as usize) {
        XNN_SUCCESS
    } else {
        XNN_INVALID_PARAMETER
    }
}
