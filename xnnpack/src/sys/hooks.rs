//! The functions packd puts in an engine's GOT slots (see [`crate::adopt`]): each reads its
//! raw arguments as XNNPACK declares them, calls the engine's real function, and hands
//! plain values to the [`Handler`] the adoption registered (this module imports nothing of
//! it); and the provider XNNPACK calls back (`struct xnn_weights_cache_provider`, laid out
//! for the interface the engine speaks).
//!
//! Signatures are XNNPACK's, identical in the 2024-11 and current headers for every function
//! hooked (`xnn_define_channelwise_quantized_tensor_value_v3` and
//! `xnn_define_blockwise_quantized_tensor_value_v2` exist only in the current one; a slot is
//! hooked only when the engine defines the function).

use std::ffi::{CStr, c_int, c_void};
use std::sync::OnceLock;

use packd_interpose::entry::{Registered, quiet};
use packd_interpose::memo::Span as Tensor;
use packd_interpose::scan::Slot;

/// What the hooks hand on: the adoption's side of each call, registered before any slot
/// points at a hook.
pub(crate) trait Handler: Sync {
    /// A static tensor a subgraph defined (after the real definition succeeded); `None`: a
    /// datatype packd does not size.
    fn defined(&self, subgraph: usize, tensor: Option<Tensor>);
    /// The subgraph was deleted (or one was made at its address): its tensors name nothing.
    fn subgraph_deleted(&self, subgraph: usize);
    /// The runtime is being deleted: what it kept, dropped after the real deletion.
    fn runtime_deleted(&self, runtime: usize) -> Option<Box<dyn std::any::Any>>;
    /// `xnn_create_runtime_v4`: `real(provider)` creates the runtime with that weights cache
    /// (0: none) and returns XNNPACK's status and the runtime.
    fn create_runtime(
        &self,
        subgraph: usize,
        engine_cache: usize,
        flags: u32,
        real: &mut dyn FnMut(usize) -> (i32, usize),
    ) -> i32;
}

/// The adoption's handler.
pub(crate) static HANDLER: Registered<dyn Handler> = Registered::new();
/// The engine's real functions, set once before any slot points at a hook.
pub(crate) static REALS: OnceLock<Reals> = OnceLock::new();

use super::provider::{XNN_INVALID_PARAMETER, XNN_SUCCESS};

type Subgraph = *mut c_void;
type DefineTensor =
    unsafe extern "C" fn(Subgraph, u32, usize, *const usize, *const c_void, u32, u32, *mut u32) -> c_int;
type DefineQuantized =
    unsafe extern "C" fn(Subgraph, u32, i32, f32, usize, *const usize, *const c_void, u32, u32, *mut u32) -> c_int;
type DefineChannelwise = unsafe extern "C" fn(
    Subgraph,
    u32,
    *const f32,
    usize,
    usize,
    *const usize,
    *const c_void,
    u32,
    u32,
    *mut u32,
) -> c_int;
type DefineChannelwiseV2 = unsafe extern "C" fn(
    Subgraph,
    u32,
    i32,
    *const f32,
    usize,
    usize,
    *const usize,
    *const c_void,
    u32,
    u32,
    *mut u32,
) -> c_int;
type DefineChannelwiseV3 = unsafe extern "C" fn(
    Subgraph,
    u32,
    i32,
    *const f32,
    usize,
    usize,
    *const usize,
    *const c_void,
    u32,
    u32,
    *mut u32,
    *const f32,
) -> c_int;
type DefineBlockwise = unsafe extern "C" fn(
    Subgraph,
    u32,
    i32,
    *const u16,
    usize,
    usize,
    usize,
    *const usize,
    *const c_void,
    u32,
    u32,
    *mut u32,
) -> c_int;
type DefineBlockwiseV2 = unsafe extern "C" fn(
    Subgraph,
    u32,
    i32,
    *const c_void,
    usize,
    usize,
    usize,
    *const usize,
    *const c_void,
    u32,
    u32,
    u32,
    *mut u32,
) -> c_int;
type CreateRuntimeV4 =
    unsafe extern "C" fn(Subgraph, *mut c_void, *mut c_void, *mut c_void, u32, *mut *mut c_void) -> c_int;
type DeleteOne = unsafe extern "C" fn(*mut c_void) -> c_int;
type CreateSubgraph = unsafe extern "C" fn(u32, u32, *mut Subgraph) -> c_int;

/// The engine's real functions (0: the engine does not define it; its slots are not hooked).
#[derive(Debug, Default)]
pub(crate) struct Reals {
    create_v4: usize,
    delete_runtime: usize,
    create_subgraph: usize,
    delete_subgraph: usize,
    define_tensor: usize,
    define_quantized: usize,
    define_cw: usize,
    define_cw_v2: usize,
    define_cw_v3: usize,
    define_bw: usize,
    define_bw_v2: usize,
}

/// A hooked symbol: its name, the hook's address, the real function's field.
type Hooked = (&'static str, usize, fn(&Reals) -> usize);

/// The hooked symbols.
fn table() -> [Hooked; 11] {
    [
        ("xnn_create_subgraph", create_subgraph as CreateSubgraph as usize, |r| r.create_subgraph),
        ("xnn_create_runtime_v4", create_v4 as CreateRuntimeV4 as usize, |r| r.create_v4),
        ("xnn_delete_runtime", delete_runtime as DeleteOne as usize, |r| r.delete_runtime),
        ("xnn_delete_subgraph", delete_subgraph as DeleteOne as usize, |r| r.delete_subgraph),
        ("xnn_define_tensor_value", define_tensor as DefineTensor as usize, |r| r.define_tensor),
        ("xnn_define_quantized_tensor_value", define_quantized as DefineQuantized as usize, |r| r.define_quantized),
        ("xnn_define_channelwise_quantized_tensor_value", define_cw as DefineChannelwise as usize, |r| r.define_cw),
        ("xnn_define_channelwise_quantized_tensor_value_v2", define_cw_v2 as DefineChannelwiseV2 as usize, |r| {
            r.define_cw_v2
        }),
        ("xnn_define_channelwise_quantized_tensor_value_v3", define_cw_v3 as DefineChannelwiseV3 as usize, |r| {
            r.define_cw_v3
        }),
        ("xnn_define_blockwise_quantized_tensor_value", define_bw as DefineBlockwise as usize, |r| r.define_bw),
        ("xnn_define_blockwise_quantized_tensor_value_v2", define_bw_v2 as DefineBlockwiseV2 as usize, |r| {
            r.define_bw_v2
        }),
    ]
}

impl Reals {
    /// The engine's functions, by `lookup(name)` (an address inside the engine, or `None`).
    pub(crate) fn find(lookup: impl Fn(&CStr) -> Option<usize>) -> Self {
        let get = |n: &CStr| lookup(n).unwrap_or(0);
        Self {
            create_v4: get(c"xnn_create_runtime_v4"),
            delete_runtime: get(c"xnn_delete_runtime"),
            create_subgraph: get(c"xnn_create_subgraph"),
            delete_subgraph: get(c"xnn_delete_subgraph"),
            define_tensor: get(c"xnn_define_tensor_value"),
            define_quantized: get(c"xnn_define_quantized_tensor_value"),
            define_cw: get(c"xnn_define_channelwise_quantized_tensor_value"),
            define_cw_v2: get(c"xnn_define_channelwise_quantized_tensor_value_v2"),
            define_cw_v3: get(c"xnn_define_channelwise_quantized_tensor_value_v3"),
            define_bw: get(c"xnn_define_blockwise_quantized_tensor_value"),
            define_bw_v2: get(c"xnn_define_blockwise_quantized_tensor_value_v2"),
        }
    }
}

/// An address inside this crate's object (the object that is never hooked).
pub(crate) fn own_address() -> usize {
    own_address as fn() -> usize as usize
}

/// The slots to hook for the engine whose functions are `reals`.
pub(crate) fn slots(reals: &Reals) -> Vec<Slot> {
    table()
        .into_iter()
        // SAFETY: the table pairs each symbol with the hook of its exact signature; the hooks
        // live in this library, which is never unloaded while its slots are in use.
        .map(|(symbol, hook, real)| unsafe { Slot::new(symbol, hook, real(reals)) })
        .collect()
}

/// The real function of `field`, as the type `F`.
///
/// # Safety
/// `F` must be the function pointer type of that real function.
unsafe fn real<F: Copy>(field: fn(&Reals) -> usize) -> Option<F> {
    let at = REALS.get().map(field).filter(|&a| a != 0)?;
    // SAFETY: `at` is the engine's function of that name (found by dlsym inside the engine),
    // whose type the caller names; function pointers are pointer-sized.
    Some(unsafe { std::mem::transmute_copy::<usize, F>(&at) })
}

/// Bits per element of the datatypes XNNPACK's static tensors can have (`enum
/// xnn_datatype`, the same numbers in every version); `None` for packed or unknown types.
fn datatype_bits(datatype: u32) -> Option<usize> {
    Some(match datatype {
        1 | 5 | 7 | 11 => 32,    // fp32, qint32, qcint32, int32
        2 | 14 => 16,            // fp16, bf16
        3 | 4 | 6 | 9 | 15 => 8, // qint8, quint8, qcint8, qdint8, qduint8
        8 | 12 | 19 => 4,        // qcint4, qbint4, qint4
        18 | 20 => 2,            // qcint2, qint2
        _ => return None,
    })
}

/// The dims at `dims` (`n` of them, at most 8).
///
/// # Safety
/// `dims` points at `n` sizes (XNNPACK's contract for the definition calls), or `n` is 0.
unsafe fn read_dims(n: usize, dims: *const usize) -> Option<Vec<usize>> {
    if n > 8 || (n > 0 && dims.is_null()) {
        return None;
    }
    if n == 0 {
        return Some(Vec::new());
    }
    // SAFETY: `n` sizes at `dims` (caller), non-NULL (checked).
    Some(unsafe { std::slice::from_raw_parts(dims, n) }.to_vec())
}

/// The bytes of `n` values of `size` bytes at `p` (copied), `None` when NULL.
///
/// # Safety
/// `p` is NULL or points at `n * size` readable bytes.
unsafe fn read_bytes(p: *const c_void, n: usize, size: usize) -> Option<Vec<u8>> {
    if p.is_null() {
        return None;
    }
    let len = n.checked_mul(size)?;
    // SAFETY: `len` readable bytes at `p` (caller), non-NULL (checked).
    Some(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) }.to_vec())
}

/// Builds the record of a static tensor: `kind` tags the definition call, `extra` its
/// quantisation parameters.
fn tensor(kind: u8, datatype: u32, dims: &[usize], data: *const c_void, extra: &[u8]) -> Option<Tensor> {
    let bits = datatype_bits(datatype)?;
    // Sub-byte types: XNNPACK's operators read each innermost row padded to whole bytes
    // (an odd row of 4-bit weights ends in a half-used byte); for whole bytes the two agree.
    let (inner, rows) = match dims.split_last() {
        Some((&inner, outer)) => (inner, outer.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))?),
        None => (1, 1),
    };
    let len = rows.checked_mul(inner.checked_mul(bits)?.checked_add(7)? / 8)?;
    let mut params = vec![kind];
    params.extend_from_slice(&datatype.to_le_bytes());
    params.extend_from_slice(&(dims.len() as u64).to_le_bytes());
    for d in dims {
        params.extend_from_slice(&(*d as u64).to_le_bytes());
    }
    params.extend_from_slice(extra);
    Some(Tensor { ptr: data as usize, len, params })
}

thread_local! {
    /// How many hooked definitions this thread is inside.
    static DEFINING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Runs a real definition; `true` with it when it is the outermost on this thread: XNNPACK
/// implements the older definition calls by calling the newer ones through its own slots,
/// and a tensor is recorded once, by the call the engine made.
fn define(call: impl FnOnce() -> c_int) -> (c_int, bool) {
    let depth = DEFINING.with(|d| d.replace(d.get() + 1));
    let status = call();
    DEFINING.with(|d| d.set(depth));
    (status, depth == 0)
}

/// Hands a definition's tensor to `adopt` when it succeeded, has static data and is the
/// engine's own call.
fn record(
    status: c_int,
    outer: bool,
    subgraph: Subgraph,
    data: *const c_void,
    t: impl FnOnce() -> Option<Tensor>,
) -> c_int {
    if outer
        && status == XNN_SUCCESS
        && !data.is_null()
        && !subgraph.is_null()
        && let Some(h) = HANDLER.get()
    {
        quiet(|| h.defined(subgraph as usize, t().filter(|t| t.len > 0)));
    }
    status
}

unsafe extern "C" fn define_tensor(
    subgraph: Subgraph,
    datatype: u32,
    num_dims: usize,
    dims: *const usize,
    data: *const c_void,
    external_id: u32,
    flags: u32,
    id_out: *mut u32,
) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<DefineTensor>(|r| r.define_tensor) }) else { return XNN_INVALID_PARAMETER };
    let (status, outer) = define(|| {
        // SAFETY: the caller's arguments, passed on as they came.
        unsafe { f(subgraph, datatype, num_dims, dims, data, external_id, flags, id_out) }
    });
    record(status, outer, subgraph, data, || {
        // SAFETY: XNNPACK accepted the definition, so `dims` holds `num_dims` sizes.
        let dims = unsafe { read_dims(num_dims, dims) }?;
        tensor(0, datatype, &dims, data, &[])
    })
}

unsafe extern "C" fn define_quantized(
    subgraph: Subgraph,
    datatype: u32,
    zero_point: i32,
    scale: f32,
    num_dims: usize,
    dims: *const usize,
    data: *const c_void,
    external_id: u32,
    flags: u32,
    id_out: *mut u32,
) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<DefineQuantized>(|r| r.define_quantized) }) else {
        return XNN_INVALID_PARAMETER;
    };
    let (status, outer) = define(|| {
        // SAFETY: the caller's arguments, passed on as they came.
        unsafe { f(subgraph, datatype, zero_point, scale, num_dims, dims, data, external_id, flags, id_out) }
    });
    record(status, outer, subgraph, data, || {
        // SAFETY: XNNPACK accepted the definition, so `dims` holds `num_dims` sizes.
        let dims = unsafe { read_dims(num_dims, dims) }?;
        let mut extra = zero_point.to_le_bytes().to_vec();
        extra.extend_from_slice(&scale.to_bits().to_le_bytes());
        tensor(1, datatype, &dims, data, &extra)
    })
}

/// The per-channel parameters of a channelwise definition: `dims[channel_dim]` floats at
/// each of `arrays` (NULL ones skipped, marked).
///
/// # Safety
/// Each non-NULL array holds `dims[channel_dim]` floats (XNNPACK's contract).
unsafe fn channel_params(
    dims: &[usize],
    channel_dim: usize,
    zero_point: i32,
    arrays: &[*const f32],
) -> Option<Vec<u8>> {
    let channels = *dims.get(channel_dim)?;
    let mut extra = zero_point.to_le_bytes().to_vec();
    extra.extend_from_slice(&(channel_dim as u64).to_le_bytes());
    for &a in arrays {
        // SAFETY: forwarded from the caller.
        match unsafe { read_bytes(a.cast(), channels, 4) } {
            Some(b) => {
                extra.push(1);
                extra.extend_from_slice(&b);
            }
            None => extra.push(0),
        }
    }
    Some(extra)
}

unsafe extern "C" fn define_cw(
    subgraph: Subgraph,
    datatype: u32,
    scale: *const f32,
    num_dims: usize,
    channel_dim: usize,
    dims: *const usize,
    data: *const c_void,
    external_id: u32,
    flags: u32,
    id_out: *mut u32,
) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<DefineChannelwise>(|r| r.define_cw) }) else { return XNN_INVALID_PARAMETER };
    let (status, outer) = define(|| {
        // SAFETY: the caller's arguments, passed on as they came.
        unsafe { f(subgraph, datatype, scale, num_dims, channel_dim, dims, data, external_id, flags, id_out) }
    });
    record(status, outer, subgraph, data, || {
        // SAFETY: XNNPACK accepted the definition: `num_dims` dims, `dims[channel_dim]` scales.
        let dims = unsafe { read_dims(num_dims, dims) }?;
        // SAFETY: as above.
        let extra = unsafe { channel_params(&dims, channel_dim, 0, &[scale]) }?;
        tensor(2, datatype, &dims, data, &extra)
    })
}

unsafe extern "C" fn define_cw_v2(
    subgraph: Subgraph,
    datatype: u32,
    zero_point: i32,
    scale: *const f32,
    num_dims: usize,
    channel_dim: usize,
    dims: *const usize,
    data: *const c_void,
    external_id: u32,
    flags: u32,
    id_out: *mut u32,
) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<DefineChannelwiseV2>(|r| r.define_cw_v2) }) else {
        return XNN_INVALID_PARAMETER;
    };
    let (status, outer) = define(|| {
        // SAFETY: the caller's arguments, passed on as they came.
        unsafe {
            f(subgraph, datatype, zero_point, scale, num_dims, channel_dim, dims, data, external_id, flags, id_out)
        }
    });
    record(status, outer, subgraph, data, || {
        // SAFETY: XNNPACK accepted the definition: `num_dims` dims, `dims[channel_dim]` scales.
        let dims = unsafe { read_dims(num_dims, dims) }?;
        // SAFETY: as above.
        let extra = unsafe { channel_params(&dims, channel_dim, zero_point, &[scale]) }?;
        tensor(3, datatype, &dims, data, &extra)
    })
}

unsafe extern "C" fn define_cw_v3(
    subgraph: Subgraph,
    datatype: u32,
    zero_point: i32,
    scale: *const f32,
    num_dims: usize,
    channel_dim: usize,
    dims: *const usize,
    data: *const c_void,
    external_id: u32,
    flags: u32,
    id_out: *mut u32,
    channelwise_zero_point: *const f32,
) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<DefineChannelwiseV3>(|r| r.define_cw_v3) }) else {
        return XNN_INVALID_PARAMETER;
    };
    let (status, outer) = define(|| {
        // SAFETY: the caller's arguments, passed on as they came.
        unsafe {
            f(
                subgraph,
                datatype,
                zero_point,
                scale,
                num_dims,
                channel_dim,
                dims,
                data,
                external_id,
                flags,
                id_out,
                channelwise_zero_point,
            )
        }
    });
    record(status, outer, subgraph, data, || {
        // SAFETY: XNNPACK accepted the definition: `num_dims` dims, `dims[channel_dim]`
        // scales and (if given) as many zero points.
        let dims = unsafe { read_dims(num_dims, dims) }?;
        // SAFETY: as above.
        let extra = unsafe { channel_params(&dims, channel_dim, zero_point, &[scale, channelwise_zero_point]) }?;
        tensor(4, datatype, &dims, data, &extra)
    })
}

/// The parameters of a blockwise definition: one scale per block of `block_size` elements
/// (2-D tensors only), `scale_size` bytes each.
///
/// # Safety
/// `scale` holds that many scales (XNNPACK's contract).
unsafe fn block_params(
    dims: &[usize],
    channel_dim: usize,
    block_size: usize,
    zero_point: i32,
    scale: *const c_void,
    scale_size: usize,
) -> Option<Vec<u8>> {
    // 2-D only: `dims[channel_dim]` channels of `dims[1 - channel_dim]` inputs, one scale per
    // block of `block_size` inputs (XNNPACK requires them to divide).
    if dims.len() != 2 || block_size == 0 || channel_dim >= 2 || !dims[1 - channel_dim].is_multiple_of(block_size) {
        return None;
    }
    let scales = dims[channel_dim].checked_mul(dims[1 - channel_dim] / block_size)?;
    let mut extra = zero_point.to_le_bytes().to_vec();
    extra.extend_from_slice(&(channel_dim as u64).to_le_bytes());
    extra.extend_from_slice(&(block_size as u64).to_le_bytes());
    extra.extend_from_slice(&(scale_size as u64).to_le_bytes());
    // SAFETY: forwarded from the caller.
    extra.extend_from_slice(&unsafe { read_bytes(scale, scales, scale_size) }?);
    Some(extra)
}

unsafe extern "C" fn define_bw(
    subgraph: Subgraph,
    datatype: u32,
    zero_point: i32,
    scale: *const u16,
    num_dims: usize,
    channel_dim: usize,
    block_size: usize,
    dims: *const usize,
    data: *const c_void,
    external_id: u32,
    flags: u32,
    id_out: *mut u32,
) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<DefineBlockwise>(|r| r.define_bw) }) else { return XNN_INVALID_PARAMETER };
    let (status, outer) = define(|| {
        // SAFETY: the caller's arguments, passed on as they came.
        unsafe {
            f(
                subgraph,
                datatype,
                zero_point,
                scale,
                num_dims,
                channel_dim,
                block_size,
                dims,
                data,
                external_id,
                flags,
                id_out,
            )
        }
    });
    record(status, outer, subgraph, data, || {
        // SAFETY: XNNPACK accepted the definition: `num_dims` dims, a bf16 scale per block.
        let dims = unsafe { read_dims(num_dims, dims) }?;
        // SAFETY: as above.
        let extra = unsafe { block_params(&dims, channel_dim, block_size, zero_point, scale.cast(), 2) }?;
        tensor(5, datatype, &dims, data, &extra)
    })
}

unsafe extern "C" fn define_bw_v2(
    subgraph: Subgraph,
    datatype: u32,
    zero_point: i32,
    scale: *const c_void,
    num_dims: usize,
    channel_dim: usize,
    block_size: usize,
    dims: *const usize,
    data: *const c_void,
    external_id: u32,
    flags: u32,
    scale_type: u32,
    id_out: *mut u32,
) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<DefineBlockwiseV2>(|r| r.define_bw_v2) }) else {
        return XNN_INVALID_PARAMETER;
    };
    let (status, outer) = define(|| {
        // SAFETY: the caller's arguments, passed on as they came.
        unsafe {
            f(
                subgraph,
                datatype,
                zero_point,
                scale,
                num_dims,
                channel_dim,
                block_size,
                dims,
                data,
                external_id,
                flags,
                scale_type,
                id_out,
            )
        }
    });
    record(status, outer, subgraph, data, || {
        let scale_size = datatype_bits(scale_type).filter(|&b| b >= 16)? / 8;
        // SAFETY: XNNPACK accepted the definition: `num_dims` dims, a scale of `scale_type`
        // per block.
        let dims = unsafe { read_dims(num_dims, dims) }?;
        // SAFETY: as above.
        let mut extra = unsafe { block_params(&dims, channel_dim, block_size, zero_point, scale, scale_size) }?;
        extra.extend_from_slice(&scale_type.to_le_bytes());
        tensor(6, datatype, &dims, data, &extra)
    })
}

unsafe extern "C" fn create_v4(
    subgraph: Subgraph,
    weights_cache: *mut c_void,
    workspace: *mut c_void,
    threadpool: *mut c_void,
    flags: u32,
    runtime_out: *mut *mut c_void,
) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<CreateRuntimeV4>(|r| r.create_v4) }) else { return XNN_INVALID_PARAMETER };
    let done = std::cell::Cell::new(None);
    let mut call = |provider: usize| {
        // SAFETY: the caller's arguments, with the weights cache packd chose (the caller's,
        // NULL, or a provider that outlives the runtime: `adopt` keeps it until the
        // runtime is deleted).
        let status = unsafe { f(subgraph, provider as *mut c_void, workspace, threadpool, flags, runtime_out) };
        done.set(Some(status));
        let runtime = if status == XNN_SUCCESS && !runtime_out.is_null() {
            // SAFETY: XNNPACK wrote the runtime there on success (the caller's pointer).
            unsafe { *runtime_out }
        } else {
            std::ptr::null_mut()
        };
        (status, runtime as usize)
    };
    let Some(h) = HANDLER.get() else { return call(weights_cache as usize).0 };
    match quiet(|| h.create_runtime(subgraph as usize, weights_cache as usize, flags, &mut call)) {
        Some(status) => status,
        // A panic in packd's part (a bug): the runtime XNNPACK made stands (a runtime made
        // with packd's provider keeps it: `adopt` registered it first), or is made now
        // without packd.
        None => match done.get() {
            Some(status) => status,
            None => call(weights_cache as usize).0,
        },
    }
}

unsafe extern "C" fn delete_runtime(runtime: *mut c_void) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<DeleteOne>(|r| r.delete_runtime) }) else { return XNN_INVALID_PARAMETER };
    // The runtime's cache leaves the map first (a runtime created at this address on
    // another thread after the real deletion must not find it), and goes after it.
    let cache = HANDLER.get().and_then(|h| quiet(|| h.runtime_deleted(runtime as usize)).flatten());
    // SAFETY: the caller's argument.
    let status = unsafe { f(runtime) };
    quiet(move || drop(cache));
    status
}

unsafe extern "C" fn create_subgraph(external_value_ids: u32, flags: u32, subgraph_out: *mut Subgraph) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<CreateSubgraph>(|r| r.create_subgraph) }) else { return XNN_INVALID_PARAMETER };
    // SAFETY: the caller's arguments, passed on as they came.
    let status = unsafe { f(external_value_ids, flags, subgraph_out) };
    if status == XNN_SUCCESS && !subgraph_out.is_null() {
        // SAFETY: XNNPACK wrote the new subgraph there (the caller's pointer).
        let subgraph = unsafe { *subgraph_out } as usize;
        // A subgraph made where one was deleted unseen names nothing of that one.
        if let Some(h) = HANDLER.get() {
            quiet(|| h.subgraph_deleted(subgraph));
        }
    }
    status
}

unsafe extern "C" fn delete_subgraph(subgraph: *mut c_void) -> c_int {
    // SAFETY: the real function of this slot, with its own type.
    let Some(f) = (unsafe { real::<DeleteOne>(|r| r.delete_subgraph) }) else { return XNN_INVALID_PARAMETER };
    if let Some(h) = HANDLER.get() {
        quiet(|| h.subgraph_deleted(subgraph as usize));
    }
    // SAFETY: the caller's argument.
    unsafe { f(subgraph) }
}

/// The bytes of a static tensor, for naming it.
pub(crate) fn tensor_bytes(t: &Tensor) -> &[u8] {
    // SAFETY: XNNPACK requires a static tensor's data to outlive the subgraph and the
    // runtimes made from it; it is read during `xnn_create_runtime_v4`, while the subgraph
    // lives, and `len` is what XNNPACK itself reads for these dims and datatype.
    unsafe { std::slice::from_raw_parts(t.ptr as *const u8, t.len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_tensors_are_sized_as_xnnpack_reads_them() {
        let at = 0x1000 as *const c_void;
        let len = |datatype: u32, dims: &[usize]| tensor(0, datatype, dims, at, &[]).map(|t| t.len);
        assert_eq!(len(1, &[2, 3]), Some(24), "fp32");
        assert_eq!(len(2, &[7]), Some(14), "fp16");
        assert_eq!(len(14, &[3, 3]), Some(18), "bf16");
        assert_eq!(len(6, &[5, 3]), Some(15), "qcint8");
        assert_eq!(len(7, &[5]), Some(20), "qcint32");
        // 4-bit rows are padded to whole bytes: 3 rows of 5 nibbles are 3 × 3 bytes.
        assert_eq!(len(8, &[3, 5]), Some(9), "qcint4, odd rows");
        assert_eq!(len(8, &[3, 6]), Some(9), "qcint4, even rows");
        assert_eq!(len(18, &[2, 5]), Some(4), "qcint2");
        assert_eq!(len(1, &[]), Some(4), "a scalar");
        assert_eq!(len(13, &[4]), None, "packed fp32: not sized");
        assert_eq!(len(99, &[4]), None, "unknown");
        assert_eq!(len(1, &[usize::MAX, 2]), None, "overflow");
    }

    #[test]
    fn packing_parameters_are_part_of_the_record() {
        let at = 0x1000 as *const c_void;
        let a = tensor(2, 6, &[4, 8], at, &[1, 2, 3]).unwrap();
        let b = tensor(2, 6, &[4, 8], at, &[1, 2, 4]).unwrap();
        let c = tensor(2, 6, &[8, 4], at, &[1, 2, 3]).unwrap();
        let d = tensor(3, 6, &[4, 8], at, &[1, 2, 3]).unwrap();
        assert!(a.params != b.params && a.params != c.params && a.params != d.params);
        let scales = [0.5f32; 4];
        // SAFETY: four floats for the 4 channels of dims[0].
        let p = unsafe { channel_params(&[4, 8], 0, 0, &[scales.as_ptr(), std::ptr::null()]) }.unwrap();
        assert_eq!(p.len(), 4 + 8 + 1 + 16 + 1, "zero point, channel dim, the scales, a missing array");
        // Blockwise: 4 channels × 8 inputs in blocks of 4 → 8 bf16 scales; blocks must divide.
        let bf16 = [0u16; 8];
        // SAFETY: eight bf16 scales.
        let p = unsafe { block_params(&[4, 8], 0, 4, 0, bf16.as_ptr().cast(), 2) }.unwrap();
        assert_eq!(p.len(), 4 + 8 + 8 + 8 + 16);
        // SAFETY: as above (not read: refused first).
        assert!(unsafe { block_params(&[4, 6], 0, 4, 0, bf16.as_ptr().cast(), 2) }.is_none());
        // SAFETY: as above (not read: refused first).
        assert!(unsafe { block_params(&[4, 8, 1], 0, 4, 0, bf16.as_ptr().cast(), 2) }.is_none());
    }
}
