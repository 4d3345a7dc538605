//! What the hooks ask of the adapter: the [`Handler`] it registers (before any slot points
//! at a hook), and what the hooks tell it.

use std::any::Any;
use std::sync::Arc;

use packd_interpose::entry::Registered;

use super::buffer::Backing;

/// A tensor as `init_tensor` placed it in the buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TensorInfo {
    pub name: String,
    pub type_: i32,
    pub ne: [i64; 4],
    pub nb: [usize; 4],
    /// Its offset in the buffer.
    pub offset: usize,
    /// `ggml_nbytes`.
    pub nbytes: usize,
}

/// A buffer as the handler is told of it: its address (ggml's handle).
pub(crate) type BufferId = usize;
/// A tensor as the handler is told of it: its address.
pub(crate) type TensorId = usize;

/// ggml writes `size` bytes from `data` into `tensor` at `offset` (`set_tensor`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Write {
    pub tensor: TensorId,
    pub data: usize,
    pub offset: usize,
    pub size: usize,
}

/// What the hooks ask of the adapter (it registers one before any slot points at a hook).
pub(crate) trait Handler: Sync {
    /// ggml's allocator was called while ggml is not (all) found: look at the loaded
    /// objects again.
    fn scan(&self);
    /// Whether libggml-base is loaded but not its CPU backend yet (the release layout).
    fn waits_for_cpu_backend(&self) -> bool;
    /// A `CPU_REPACK` buffer of `size` bytes has `backing` under it from now on.
    fn adopted(&self, buffer: BufferId, backing: Arc<Backing>, size: usize);
    /// A `CPU_REPACK` buffer of `size` bytes is left to ggml, for `why`.
    fn not_adopted(&self, size: usize, why: AdoptError);
    /// ggml placed `tensor` in the buffer (`view`: a view of another tensor).
    fn placed(&self, buffer: BufferId, tensor: TensorId, info: TensorInfo, view: bool);
    /// ggml writes a tensor (`write`); `repack` runs ggml's own `set_tensor` (which
    /// repacks), on memory the handler backed writable.
    fn set(&self, buffer: BufferId, write: Write, repack: &mut dyn FnMut());
    /// ggml's `memset_tensor`; `memset` runs ggml's own, on memory the handler backed.
    fn memset(&self, buffer: BufferId, memset: &mut dyn FnMut());
    /// ggml's `clear` of the buffer with `value`.
    fn clear(&self, buffer: BufferId, value: u8);
    /// ggml frees the buffer: what it returns is dropped after ggml's own free (the
    /// memory goes then).
    fn freed(&self, buffer: BufferId) -> Option<Box<dyn Any>>;
    /// A buffer of an extra buffer type `buft`, of `size` bytes (not shared).
    fn unshared(&self, buft: &str, size: usize);
    /// A tensor of ggml type `ty`, `bytes` as ggml counts them, in a buffer of the extra
    /// buffer type `buft`.
    fn unshared_tensor(&self, buft: &str, ty: &str, bytes: usize);
}

/// The handler the hooks call.
pub(crate) static HANDLER: Registered<dyn Handler> = Registered::new();

/// Why a `CPU_REPACK` buffer is left to ggml.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AdoptError {
    #[error("the CPU_REPACK buffer lacks a function packd needs (another ggml build?)")]
    MissingFunction,
    #[error("the CPU_REPACK buffer has a 2-D copy packd does not take over (another ggml build?)")]
    OtherWriter,
    #[error("the CPU_REPACK buffer is not laid out as this ggml version's CPU buffer")]
    Layout,
    #[error("cannot reserve {len} bytes of address space: {source}")]
    Reserve { len: usize, source: std::io::Error },
}
