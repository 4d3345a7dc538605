//! The only `unsafe` of the Python bindings: exporting a mapping's bytes through the
//! buffer protocol, duplicating a file descriptor a caller passes as an `int`, and ending a
//! LiteRT weight cache after the compile.

use std::ffi::{c_int, c_void};
use std::fs::File;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use std::sync::Arc;

use packd_client::Model;

/// A read-only byte range of a mapping, exported through the buffer protocol; keeps the
/// mapping alive.
#[pyclass(frozen, module = "packd._native")]
pub(crate) struct View {
    model: Arc<Model>,
    offset: usize,
    length: usize,
}

impl View {
    /// `length` bytes at `offset` of `model`'s mapping, which the caller checked lie in it.
    pub(crate) fn new(model: Arc<Model>, offset: usize, length: usize) -> Self {
        assert!(offset.checked_add(length).is_some_and(|end| end <= model.bytes().len()), "a view inside the mapping");
        Self { model, offset, length }
    }

    fn bytes(&self) -> &[u8] {
        &self.model.bytes()[self.offset..self.offset + self.length]
    }
}

/// A duplicate of the file descriptor a Python caller passed as an `int` (never a `bool`:
/// the caller of this function refuses those, since `True` would be fd 1).
pub(crate) fn dup_caller_fd(fd: i32) -> std::io::Result<File> {
    // SAFETY: a Python caller that passes an int as a model source states that it is its
    // own open file descriptor, kept open while the call runs (the API's documented
    // contract, as for `os.read`); it is only duplicated, and a number that is not open
    // fails with EBADF.
    unsafe { packd_client::sys::dup_raw_fd(fd) }
}

/// [`packd_litert::WeightCache::finish`], for `packd.litert`'s wrapper of LiteRT's compile.
pub(crate) fn finish_litert(cache: &mut packd_litert::WeightCache) -> packd_litert::Outcome {
    // SAFETY: `packd.litert` calls this (as `LiteRtCache._finish`, a private method) right
    // after `CompiledModel.from_file`/`from_buffer` returned and before it hands the model to
    // its caller: nothing else holds the model, so no other thread can make LiteRT map,
    // unmap or resize its cache mappings meanwhile.
    unsafe { cache.finish() }
}

#[pymethods]
impl View {
    /// Exports the bytes read-only, one-dimensional, format "B"; the exporter (this view,
    /// which holds the mapping) stays alive while any consumer holds the buffer.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("the buffer view is NULL"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err("packd's segments are read-only (sealed shared memory)"));
        }
        let (ptr, len) = {
            let this = slf.get();
            let bytes = this.bytes();
            (bytes.as_ptr(), bytes.len())
        };
        let len = isize::try_from(len).map_err(|_| PyBufferError::new_err("segment too large"))?;
        let wanted = |flag: c_int| flags & flag == flag;
        // `shape` and `strides` point at the view's own `len` and `itemsize` (a 1-D buffer
        // of bytes): addresses computed without reading or writing anything.
        let field = |offset: usize| view.wrapping_byte_add(offset).cast::<ffi::Py_ssize_t>();
        let filled = ffi::Py_buffer {
            buf: ptr.cast_mut().cast::<c_void>(),
            // The view's reference moves into the buffer: the consumer's release drops it.
            obj: slf.into_any().into_ptr(),
            len,
            itemsize: 1,
            readonly: 1,
            ndim: 1,
            format: if wanted(ffi::PyBUF_FORMAT) { c"B".as_ptr().cast_mut() } else { std::ptr::null_mut() },
            shape: if wanted(ffi::PyBUF_ND) {
                field(std::mem::offset_of!(ffi::Py_buffer, len))
            } else {
                std::ptr::null_mut()
            },
            strides: if wanted(ffi::PyBUF_STRIDES) {
                field(std::mem::offset_of!(ffi::Py_buffer, itemsize))
            } else {
                std::ptr::null_mut()
            },
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        };
        // SAFETY: `view` is non-NULL and points to a Py_buffer the interpreter owns for this
        // call: one write of a whole value. `buf` points into the mapping that `obj` (this
        // view) keeps alive until the consumer releases the buffer; the memory is never
        // written (readonly = 1, and the segment is sealed). `shape` and `strides` point into
        // the Py_buffer itself, which outlives their use; the format string is static.
        unsafe { view.write(filled) };
        Ok(())
    }

    /// Nothing to free: the format string is static and the reference to the exporter is
    /// dropped by the interpreter.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
