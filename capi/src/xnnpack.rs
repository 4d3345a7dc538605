//! The C ABI of packd's XNNPACK weights-cache provider: the functions
//! `include/packd_xnnpack.h` fills XNNPACK's `struct xnn_weights_cache_provider` with (and
//! declares in `packd.h`, generated with the rest). The provider's callbacks, which XNNPACK
//! calls while it builds a runtime, are not guarded: a panic there (a bug) aborts the
//! process rather than go on with a weights cache in an unknown state.

use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::Mutex;

use packd_xnnpack::{XnnCache, XnnKey};

use crate::ffi::{clear_out, given, guarded, invalid, opt_str, req_str, text};
use crate::packd::{PackdClient, PackdStatus};

// ───────────────────────── XNNPACK weights cache ─────────────────────────

/// A packd-backed XNNPACK weights cache (opaque). Fill XNNPACK's
/// `struct xnn_weights_cache_provider` with it through `packd_xnnpack.h`
/// (`packd_xnn_fill_provider`), which compiles against the engine's own `xnnpack.h`.
pub struct PackdXnnCache {
    cache: packd_xnnpack::XnnCache,
    identity: CString,
    /// The last reason handed out by `packd_xnn_cache_reason` (kept alive for the caller).
    reason: Mutex<CString>,
}

/// What a [`PackdXnnCache`] does for this process.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackdXnnMode {
    /// Serves look-ups from a segment another process published.
    Served = 0,
    /// Builds the segment; `packd_xnn_cache_finalize` publishes it.
    Building = 1,
    /// Published the segment it built.
    Published = 2,
    /// Packs privately (the reason is in `packd_xnn_cache_reason`).
    Private = 3,
}

/// Counters of a [`PackdXnnCache`] (see `packd_xnn_cache_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PackdXnnStats {
    /// `look_up` calls answered with an offset.
    pub hits: u64,
    /// `look_up` calls answered "not found".
    pub misses: u64,
    /// `reserve_space` calls: weights XNNPACK packed in this process.
    pub reserve_space: u64,
    /// Bytes XNNPACK packed in this process.
    pub bytes_packed: u64,
    /// Bytes of packed weights held privately by this process.
    pub bytes_private: u64,
    /// Bytes of the XNNPACK segment this cache maps (served, or published by this process);
    /// the model's own mapping is not counted.
    pub bytes_shared: u64,
    /// Weights whose key held an address nobody named (packed privately, never shared).
    pub unnamed: u64,
    /// Inserts under a name already filed with other bytes (kept privately, never served).
    pub conflicts: u64,
    /// Inserts answered with an identical copy already held.
    pub deduplicated: u64,
    /// The mode, a [`PackdXnnMode`].
    pub mode: u32,
}

/// Options of [`packd_xnn_cache_create`]; zero-initialise, then set what you need.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PackdXnnOptions {
    /// The model: the source digest of its weights (a packd segment's `source_blake3`) or
    /// another name that changes whenever any weight does. Required.
    pub model: *const c_char,
    /// The address of any function of the XNNPACK library in use (e.g.
    /// `(const void*)&xnn_create_runtime_v4`): its build is found from it. Required.
    pub engine_symbol: *const std::ffi::c_void,
    /// Extra text for the identity (anything else that changes packed bytes: runtime
    /// flags, ...); NULL for none.
    pub extra: *const c_char,
    /// Seconds to ask for as the builder (0: the daemon's limits.build_timeout).
    pub build_seconds: u32,
    /// Seconds to wait at most for another process's build (0: limits.build_wait).
    pub wait_seconds: u32,
    /// Non-zero: do not ask packd; pack privately (a baseline).
    pub private_only: u32,
}

/// Creates a weights cache for a model and the XNNPACK build and CPU this process runs,
/// asking packd for the identity's published segment at once. It serves it, becomes its
/// builder, or packs privately (packd away, another process's build overran): packd being
/// away, refusing or slow never makes it fail; a published segment that cannot be mapped
/// (`IO`) or whose memfd is not the size the reply says (`PROTOCOL`) does. Fill XNNPACK's
/// provider with `packd_xnn_fill_provider`
/// (`packd_xnnpack.h`), create the runtime, then call [`packd_xnn_cache_finalize`].
/// Free with [`packd_xnn_cache_free`] after every runtime using it was deleted.
///
/// Thread safety: safe from any thread.
///
/// # Safety
/// `client` is NULL or a live client; `options` is NULL or valid; `out` is NULL or valid
/// for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_cache_create(
    client: *const PackdClient,
    options: *const PackdXnnOptions,
    out: *mut *mut PackdXnnCache,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: forwarded from the caller.
        unsafe { clear_out(out) }?;
        // SAFETY: NULL or a live client (caller's promise).
        let c = unsafe { given(client, "client")?.as_ref() };
        // SAFETY: NULL or valid (caller's promise).
        let o = unsafe { given(options, "options")?.as_ref() };
        // SAFETY: a valid C string or NULL (caller's promise).
        let model = unsafe { req_str(o.model, "options.model") }?;
        // SAFETY: a valid C string or NULL (caller's promise).
        let extra = unsafe { opt_str(o.extra, "options.extra") }?.unwrap_or("");
        if o.engine_symbol.is_null() {
            return Err(invalid("options.engine_symbol is NULL: pass the address of an XNNPACK function"));
        }
        let engine = packd_xnnpack::engine_identity(o.engine_symbol as usize)
            .ok_or_else(|| invalid("options.engine_symbol lies in no mapped file"))?;
        let engine = if extra.is_empty() { engine } else { format!("{engine};{extra}") };
        let identity = packd_xnnpack::identity(model, &engine, &packd_xnnpack::cpu_identity());
        let options = packd_client::AcquireOptions {
            build_seconds: o.build_seconds,
            wait_seconds: o.wait_seconds,
            build_bytes: 0,
            verified: false,
        };
        let cache = packd_xnnpack::XnnCache::new(c.client.clone(), identity, options, o.private_only != 0)?;
        let identity = text(cache.identity());
        let boxed = Box::new(PackdXnnCache { cache, identity, reason: Mutex::new(CString::default()) });
        // SAFETY: checked non-NULL by clear_out.
        unsafe { *out = Box::into_raw(boxed) };
        Ok(())
    })
}

/// Names the weights at `[ptr, ptr + len)` `name`, so keys holding addresses in it can be
/// shared. Weights mapped from packd (`packd_pack_path`, `packd_get`) are named already
/// (by their entry keys, while the model is mapped). The name must change whenever the
/// bytes there, or any other parameter XNNPACK packs with them (bias, scales), change. It
/// holds until [`packd_xnn_cache_unname`] or the cache is freed.
///
/// Thread safety: safe from any thread.
///
/// # Safety
/// `cache` is NULL or live; `name` a valid C string or NULL.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_cache_name(
    cache: *const PackdXnnCache,
    ptr: *const std::ffi::c_void,
    len: usize,
    name: *const c_char,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or live (caller's promise).
        let c = unsafe { given(cache, "cache")?.as_ref() };
        // SAFETY: a valid C string or NULL (caller's promise).
        let name = unsafe { req_str(name, "name") }?;
        if ptr.is_null() || len == 0 {
            return Err(invalid("the range is empty"));
        }
        c.cache.name_range(ptr as usize, len, name);
        Ok(())
    })
}

/// The key of XNNPACK's 2024-11 interface.
fn key(seed: u32, kernel: *const std::ffi::c_void, bias: *const std::ffi::c_void) -> XnnKey {
    XnnKey::new(seed, kernel as usize, bias as usize)
}

/// The key of XNNPACK's current interface (with `fingerprint_id`).
fn key_fp(seed: u32, kernel: *const std::ffi::c_void, bias: *const std::ffi::c_void, fingerprint: u32) -> XnnKey {
    XnnKey { fingerprint: Some(fingerprint), ..key(seed, kernel, bias) }
}

/// The cache behind a provider's `context`, or `None` for NULL.
///
/// # Safety
/// `context` is NULL or a live [`PackdXnnCache`].
unsafe fn context<'a>(context: *mut std::ffi::c_void) -> Option<&'a XnnCache> {
    // SAFETY: NULL or a live cache (caller's promise).
    unsafe { context.cast::<PackdXnnCache>().as_ref() }.map(|c| &c.cache)
}

/// Forgets the range named at `ptr` by [`packd_xnn_cache_name`]: call it before that memory
/// is freed or reused, so that its addresses name nothing any more.
///
/// Thread safety: safe from any thread.
///
/// # Safety
/// `cache` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_cache_unname(
    cache: *const PackdXnnCache,
    ptr: *const std::ffi::c_void,
) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or live (caller's promise).
        let c = unsafe { given(cache, "cache")?.as_ref() };
        c.cache.unname_range(ptr as usize);
        Ok(())
    })
}

/// XNNPACK's `look_up` (2024-11 interface), with the key's fields (`packd_xnnpack.h`
/// passes them).
///
/// # Safety
/// `context` is a live [`PackdXnnCache`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_look_up(
    context: *mut std::ffi::c_void,
    seed: u32,
    kernel: *const std::ffi::c_void,
    bias: *const std::ffi::c_void,
) -> usize {
    // SAFETY: forwarded from the caller.
    let Some(c) = (unsafe { self::context(context) }) else { return usize::MAX };
    catch_unwind(AssertUnwindSafe(|| c.look_up(&key(seed, kernel, bias)))).unwrap_or(usize::MAX)
}

/// XNNPACK's `look_up` (current interface: the key has `fingerprint_id`).
///
/// # Safety
/// `context` is a live [`PackdXnnCache`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_look_up2(
    context: *mut std::ffi::c_void,
    seed: u32,
    kernel: *const std::ffi::c_void,
    bias: *const std::ffi::c_void,
    fingerprint_id: u32,
) -> usize {
    // SAFETY: forwarded from the caller.
    let Some(c) = (unsafe { self::context(context) }) else { return usize::MAX };
    catch_unwind(AssertUnwindSafe(|| c.look_up(&key_fp(seed, kernel, bias, fingerprint_id)))).unwrap_or(usize::MAX)
}

/// XNNPACK's `reserve_space`: `n` bytes, 64-byte aligned, that never move; NULL on failure.
///
/// # Safety
/// `context` is a live [`PackdXnnCache`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_reserve_space(context: *mut std::ffi::c_void, n: usize) -> *mut std::ffi::c_void {
    // SAFETY: forwarded from the caller.
    let Some(c) = (unsafe { self::context(context) }) else { return ptr::null_mut() };
    catch_unwind(AssertUnwindSafe(|| c.reserve_space(n))).unwrap_or(0) as *mut std::ffi::c_void
}

/// XNNPACK's `look_up_or_insert` (2024-11 interface): with `ptr` NULL (convolutions, after
/// a hit) the offset of the weights the key names; otherwise `ptr` is the block the calling
/// thread's `reserve_space` returned, holding `size` written bytes: returns the offset of
/// the weights (`ptr`'s or an identical copy's). Any other `ptr` is refused (`SIZE_MAX`,
/// nothing read).
///
/// # Safety
/// `context` is a live [`PackdXnnCache`]; the bytes of a block it handed out are written
/// by the caller before this call and not afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_look_up_or_insert(
    context: *mut std::ffi::c_void,
    seed: u32,
    kernel: *const std::ffi::c_void,
    bias: *const std::ffi::c_void,
    ptr: *mut std::ffi::c_void,
    size: usize,
) -> usize {
    // SAFETY: forwarded from the caller.
    let Some(c) = (unsafe { self::context(context) }) else { return usize::MAX };
    catch_unwind(AssertUnwindSafe(|| c.look_up_or_insert(&key(seed, kernel, bias), ptr as usize, size)))
        .unwrap_or(usize::MAX)
}

/// XNNPACK's `look_up_or_insert` (current interface: the key has `fingerprint_id`), as
/// [`packd_xnn_look_up_or_insert`].
///
/// # Safety
/// As [`packd_xnn_look_up_or_insert`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_look_up_or_insert2(
    context: *mut std::ffi::c_void,
    seed: u32,
    kernel: *const std::ffi::c_void,
    bias: *const std::ffi::c_void,
    fingerprint_id: u32,
    ptr: *mut std::ffi::c_void,
    size: usize,
) -> usize {
    // SAFETY: forwarded from the caller.
    let Some(c) = (unsafe { self::context(context) }) else { return usize::MAX };
    let key = key_fp(seed, kernel, bias, fingerprint_id);
    catch_unwind(AssertUnwindSafe(|| c.look_up_or_insert(&key, ptr as usize, size))).unwrap_or(usize::MAX)
}

/// XNNPACK's `alias_data` (current interface): `alias` is another address of the packed
/// data at `original`. packd's weights never move, so it only records the call; returns
/// true (XNNPACK's `xnn_status_success` is mapped by `packd_xnnpack.h`).
///
/// # Safety
/// `context` is a live [`PackdXnnCache`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_alias_data(
    context: *mut std::ffi::c_void,
    alias: *mut std::ffi::c_void,
    original: *mut std::ffi::c_void,
) -> bool {
    // SAFETY: forwarded from the caller.
    let Some(c) = (unsafe { self::context(context) }) else { return false };
    catch_unwind(AssertUnwindSafe(|| c.alias_data(alias as usize, original as usize))).unwrap_or(false)
}

/// XNNPACK's `is_finalized`: always true (setup may run at any time; weights never move).
#[unsafe(no_mangle)]
pub extern "C" fn packd_xnn_is_finalized(_context: *mut std::ffi::c_void) -> bool {
    true
}

/// XNNPACK's `offset_to_addr`.
///
/// # Safety
/// `context` is a live [`PackdXnnCache`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_offset_to_addr(
    context: *mut std::ffi::c_void,
    offset: usize,
) -> *mut std::ffi::c_void {
    // SAFETY: forwarded from the caller.
    let Some(c) = (unsafe { self::context(context) }) else { return ptr::null_mut() };
    c.offset_to_addr(offset) as *mut std::ffi::c_void
}

/// Publishes what this process built (when it was the builder); nothing otherwise. Call it
/// once the runtime is created. Built weights stay at their addresses, read-only; the
/// publication runs on a thread of its own ([`packd_xnn_cache_wait`] waits for it). A
/// publication packd refuses leaves them private (see `packd_xnn_cache_reason`): that is
/// not an error.
///
/// Thread safety: not concurrently with runtime creation on the same cache.
///
/// # Safety
/// `cache` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_cache_finalize(cache: *const PackdXnnCache) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or live (caller's promise).
        let c = unsafe { given(cache, "cache")?.as_ref() };
        Ok(c.cache.finalize()?)
    })
}

/// Waits until the publication [`packd_xnn_cache_finalize`] started (on a thread of its
/// own) has been answered; then the mode is `PUBLISHED`, or `PRIVATE` with the reason.
/// Returns at once when nothing is being published.
///
/// # Safety
/// `cache` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_cache_wait(cache: *const PackdXnnCache) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or live (caller's promise).
        let c = unsafe { given(cache, "cache")?.as_ref() };
        c.cache.wait_published();
        Ok(())
    })
}

/// Fills `*out` with the cache's counters.
///
/// Returns `OK`; `INVALID_ARGUMENT` (a NULL cache or `out`).
///
/// # Safety
/// `cache` is NULL or live; `out` is NULL or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_cache_stats(cache: *const PackdXnnCache, out: *mut PackdXnnStats) -> PackdStatus {
    guarded(|| {
        // SAFETY: NULL or live (caller's promise).
        let c = unsafe { given(cache, "cache")?.as_ref() };
        given(out, "out")?;
        let s = c.cache.stats();
        let stats = PackdXnnStats {
            hits: s.hits,
            misses: s.misses,
            reserve_space: s.reserve_space,
            bytes_packed: s.bytes_packed,
            bytes_private: s.bytes_private,
            bytes_shared: s.bytes_shared,
            unnamed: s.unnamed,
            conflicts: s.conflicts,
            deduplicated: s.deduplicated,
            mode: s.mode.map_or(PackdXnnMode::Private as u32, |m| m as u32),
        };
        // SAFETY: non-NULL (checked) and valid for writes (caller's promise).
        unsafe { *out = stats };
        Ok(())
    })
}

/// The weights-cache interface of the XNNPACK library holding `engine_symbol` (the address
/// of any of its functions, e.g. `(const void*)&xnn_create_runtime_v4`), told at run time
/// by the symbols it exports: 202411, 202511 or 202603 (`PACKD_XNN_INTERFACE`'s values).
/// For code that fills a provider for an engine it was not compiled against; code that
/// includes the engine's `xnnpack.h` has `PACKD_XNN_INTERFACE` at compile time.
///
/// Returns `OK` with `*out` set; `INVALID_ARGUMENT` when the library is not an XNNPACK
/// packd knows (the message says why; `*out` is 0).
///
/// # Safety
/// `out` is NULL or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_engine_interface(
    engine_symbol: *const std::ffi::c_void,
    out: *mut u32,
) -> PackdStatus {
    guarded(|| {
        given(out, "out")?;
        // SAFETY: non-NULL (checked) and valid for writes (caller's promise).
        unsafe { *out = 0 };
        if engine_symbol.is_null() {
            return Err(invalid("engine_symbol is NULL: pass the address of an XNNPACK function"));
        }
        let interface = packd_xnnpack::engine_interface(engine_symbol as usize).map_err(|e| invalid(e.to_string()))?;
        // SAFETY: as above.
        unsafe { *out = interface };
        Ok(())
    })
}

/// The cache identity (valid while the cache lives).
///
/// # Safety
/// `cache` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_cache_identity(cache: *const PackdXnnCache) -> *const c_char {
    // SAFETY: NULL or live (caller's promise).
    unsafe { cache.as_ref() }.map_or(c"".as_ptr(), |c| c.identity.as_ptr())
}

/// Why the cache packs privately ("" when it does not); valid until the next call of this
/// function on the same cache.
///
/// Thread safety: not concurrently with itself on the same cache.
///
/// # Safety
/// `cache` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_cache_reason(cache: *const PackdXnnCache) -> *const c_char {
    // SAFETY: NULL or live (caller's promise).
    let Some(c) = (unsafe { cache.as_ref() }) else { return c"".as_ptr() };
    // A panic must not cross the boundary: the reason kept before stays.
    let now = catch_unwind(AssertUnwindSafe(|| text(&c.cache.stats().reason)));
    let mut reason = c.reason.lock().unwrap_or_else(|p| p.into_inner());
    if let Ok(now) = now {
        *reason = now;
    }
    reason.as_ptr()
}

/// Frees a cache: unmaps its weights and ends its lease. NULL is ignored. A cache whose
/// publication is still in flight first waits for its answer (at most the client's pack
/// timeout), so that the weights it built reach the host.
///
/// Thread safety: only after every XNNPACK runtime that used it was deleted.
///
/// # Safety
/// `cache` is NULL or came from [`packd_xnn_cache_create`] and is not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn packd_xnn_cache_free(cache: *mut PackdXnnCache) {
    if !cache.is_null() {
        // SAFETY: created by Box::into_raw in packd_xnn_cache_create; ownership returns here once.
        let cache = unsafe { Box::from_raw(cache) };
        // Dropping waits for a publication and reports: a panic there must not cross the
        // boundary (what is left of the cache is then leaked, not freed twice).
        let _ = catch_unwind(AssertUnwindSafe(move || drop(cache)));
    }
}
