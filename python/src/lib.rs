//! `packd._native`: the Python face of the Rust client library. The `packd` package (in
//! `python/packd/`) wraps it in NumPy arrays; this module gives it a connection, mapped
//! segments, and read-only buffers over byte ranges of a mapping (the buffer protocol
//! lives in [`sys`], the only module of this crate that handles raw pointers).

mod sys;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use packd_client::{Error, Model, Plan, Timeouts};
use pyo3::exceptions::{PyException, PyIndexError, PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList};
use sys::View;

pyo3::create_exception!(
    packd,
    PackdError,
    PyException,
    "A packd call failed: `code` is the daemon's or the client's error code (e.g. \"NOT_FOUND\"), `message` the reason."
);

/// A `PackdError` with `code` and `message` attributes; a failure of the operating system
/// (opening the file, connecting, a socket or mapping call) is the `OSError` subclass its
/// errno selects (`FileNotFoundError`, `PermissionError`, …), with `errno`, `filename` and
/// the same `code` and `message`.
fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let code = e.code();
    let message = match e {
        Error::Daemon { message, .. } => message.clone(),
        other => other.to_string(),
    };
    let os = match e {
        Error::Open { path, source } | Error::Connect { path, source } => {
            source.raw_os_error().map(|errno| (errno, Some(path.display().to_string())))
        }
        Error::Io(source) => source.raw_os_error().map(|errno| (errno, None)),
        _ => None,
    };
    let err = match os {
        // OSError(errno, strerror, filename) constructs the subclass errno selects.
        Some((errno, Some(file))) => PyOSError::new_err((errno, message.clone(), file)),
        Some((errno, None)) => PyOSError::new_err((errno, message.clone())),
        None => PackdError::new_err(format!("{message} ({code})")),
    };
    let value = err.value(py);
    // Attributes on a fresh exception instance cannot fail to be set.
    let _ = value.setattr("code", code);
    let _ = value.setattr("message", message);
    err
}

/// A connection to packd's data plane. Safe to share between threads; calls release the
/// GIL while they wait for the daemon.
#[pyclass(frozen, module = "packd._native")]
struct Client {
    inner: packd_client::Client,
}

/// A model file given as a path or an open file descriptor.
enum Source {
    Path(PathBuf),
    Fd(i32),
}

fn source_of(obj: &Bound<'_, PyAny>) -> PyResult<Source> {
    // `True` would extract as fd 1 (stdout): a bool is never a file descriptor.
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err("source must be a path or an open file descriptor (int), not a bool"));
    }
    if let Ok(fd) = obj.extract::<i32>() {
        return Ok(Source::Fd(fd));
    }
    if let Ok(path) = obj.extract::<PathBuf>() {
        return Ok(Source::Path(path));
    }
    Err(PyTypeError::new_err("source must be a path (str or os.PathLike) or an open file descriptor (int)"))
}

#[pymethods]
impl Client {
    /// Connects to `SOCKET_DIR/packd.sock`; `None` means the default (`$PACKD_SOCKET_DIR`,
    /// `/run/packd`, `$XDG_RUNTIME_DIR/packd`). Deadlines in seconds; `None` keeps the
    /// client library's default (`timeout`: the daemon's silence on any call,
    /// `pack_timeout`: a whole pack, `connect_timeout`: connecting).
    #[new]
    #[pyo3(signature = (socket_dir=None, *, timeout=None, pack_timeout=None, connect_timeout=None))]
    fn new(
        py: Python<'_>,
        socket_dir: Option<PathBuf>,
        timeout: Option<f64>,
        pack_timeout: Option<f64>,
        connect_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let mut timeouts = Timeouts::default();
        for (value, field) in
            [(timeout, &mut timeouts.get), (pack_timeout, &mut timeouts.pack), (connect_timeout, &mut timeouts.connect)]
        {
            if let Some(secs) = value {
                *field = Duration::try_from_secs_f64(secs).ok().filter(|d| !d.is_zero()).ok_or_else(|| {
                    PyValueError::new_err(format!("a timeout must be a positive number of seconds, not {secs}"))
                })?;
            }
        }
        if socket_dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
            return Err(PyValueError::new_err("socket_dir is empty: pass None for the default directory"));
        }
        let dir = socket_dir.unwrap_or_else(packd_client::default_socket_dir);
        let inner = py.detach(|| packd_client::Client::connect_with(dir, timeouts)).map_err(|e| to_py(py, &e))?;
        Ok(Self { inner })
    }

    /// Packs the model (or finds it packed) and maps it. `layout` is the default GEMM
    /// rule's layout (`None`: `f32-gemm:nr=16,kr=1,sr=1`; `"identity"` keeps every tensor
    /// as is); `rules` are `GLOB=LAYOUT` rules tried first. `progress`, if given, is called
    /// as `progress(stage, bytes_done, bytes_total)` with each of the daemon's progress
    /// reports (at least one a second while the pack runs); an exception it raises is
    /// printed and ignored.
    #[pyo3(signature = (source, layout=None, rules=Vec::new(), progress=None))]
    fn pack(
        &self,
        py: Python<'_>,
        source: &Bound<'_, PyAny>,
        layout: Option<String>,
        rules: Vec<String>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Segment> {
        let source = source_of(source)?;
        let plan = Plan { rules, layout: layout.unwrap_or_default() };
        let report = |p: &packd_client::proto::Progress| {
            if let Some(callback) = &progress {
                Python::attach(|py| {
                    let stage = stage_name(p.stage);
                    if let Err(e) = callback.call1(py, (stage, p.bytes_done, p.bytes_total)) {
                        e.print(py);
                    }
                });
            }
        };
        let model = py
            .detach(|| {
                let (file, label) = match source {
                    Source::Path(p) => packd_client::open_source(&p)?,
                    Source::Fd(fd) => (sys::dup_caller_fd(fd).map_err(Error::Io)?, String::new()),
                };
                self.inner.pack_with_progress(&file, &plan, &label, &report)?.map()
            })
            .map_err(|e| to_py(py, &e))?;
        Ok(Segment { model: Arc::new(model) })
    }

    /// Maps the packed segment holding `key` (a segment key or an entry key).
    fn get(&self, py: Python<'_>, key: String) -> PyResult<Segment> {
        let model = py.detach(|| self.inner.get(&key)).map_err(|e| to_py(py, &e))?;
        Ok(Segment { model: Arc::new(model) })
    }

    /// Tells packd how this worker obtained `model`'s weights: `obtained` is "served",
    /// "built" or "private"; `reason` (for "private") a fallback name such as
    /// "unknown_interface" (see docs/OPERATIONS.md). Not answered.
    #[pyo3(signature = (engine, model, obtained, reason=None, detail=String::new(), private_bytes=0, shared_bytes=0))]
    #[allow(clippy::too_many_arguments)]
    fn report(
        &self,
        engine: String,
        model: String,
        obtained: &str,
        reason: Option<&str>,
        detail: String,
        private_bytes: u64,
        shared_bytes: u64,
    ) -> PyResult<()> {
        let report = report_of(engine, model, obtained, reason, detail, private_bytes, shared_bytes)?;
        self.inner.report(&report);
        Ok(())
    }
}

/// A report from Python's arguments (see `Client.report`).
fn report_of(
    engine: String,
    model: String,
    obtained: &str,
    reason: Option<&str>,
    detail: String,
    private_bytes: u64,
    shared_bytes: u64,
) -> PyResult<packd_client::Report> {
    use packd_client::{Fallback, Obtained};
    let fallback = match reason {
        None => None,
        Some(r) => Some(
            Fallback::from_str_name(&r.to_ascii_uppercase())
                .or_else(|| (r == "other").then_some(Fallback::Other))
                .filter(|f| *f != Fallback::Unspecified)
                .ok_or_else(|| PyValueError::new_err(format!("unknown reason {r:?} (see docs/OPERATIONS.md)")))?,
        ),
    };
    let obtained = match (obtained, fallback) {
        ("served", None) => Obtained::Served,
        ("built", None) => Obtained::Built,
        ("private", Some(f)) => Obtained::Private(f),
        ("private", None) => return Err(PyValueError::new_err("a private report needs a reason")),
        ("served" | "built", Some(_)) => return Err(PyValueError::new_err("only a private report has a reason")),
        (o, _) => return Err(PyValueError::new_err(format!("obtained must be served, built or private, not {o:?}"))),
    };
    Ok(packd_client::Report { engine, model, obtained, detail, private_bytes, shared_bytes })
}

/// Keeps a report made while packd cannot be reached: the next client of this process that
/// connects sends it. False when 64 others wait already (not kept).
#[pyfunction]
#[pyo3(signature = (engine, model, reason, detail=String::new(), private_bytes=0))]
fn report_later(engine: String, model: String, reason: &str, detail: String, private_bytes: u64) -> PyResult<bool> {
    let report = report_of(engine, model, "private", Some(reason), detail, private_bytes, 0)?;
    Ok(packd_client::report_later(&report))
}

/// The name of a progress stage as Python's callback gets it.
fn stage_name(stage: i32) -> &'static str {
    use packd_client::proto::ProgressStage;
    match ProgressStage::try_from(stage) {
        Ok(ProgressStage::Waiting) => "waiting",
        Ok(ProgressStage::Hashing) => "hashing",
        Ok(ProgressStage::Packing) => "packing",
        _ => "accepted",
    }
}

/// A mapped segment: read-only shared memory and its entry table. The mapping (and the
/// lease) lives while this object or any buffer from it lives.
#[pyclass(frozen, module = "packd._native")]
struct Segment {
    model: Arc<Model>,
}

#[pymethods]
impl Segment {
    /// The segment key.
    #[getter]
    fn key(&self) -> &str {
        self.model.key()
    }

    /// Size of the mapping in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.model.bytes().len()
    }

    /// Address of the mapping's first byte (to check that arrays view it, not a copy).
    #[getter]
    fn address(&self) -> usize {
        self.model.bytes().as_ptr() as usize
    }

    /// Who published the segment, as a dict (uid, gid, groups, identity); None for a
    /// segment packd packed itself.
    fn publisher<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(p) = &self.model.info().publisher else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("uid", p.uid)?;
        d.set_item("gid", p.gid)?;
        d.set_item("groups", p.groups.clone())?;
        d.set_item("identity", &p.identity)?;
        Ok(Some(d))
    }

    /// The entries in source order, as dicts: name, key, layout, dtype, shape, offset,
    /// length, blake3, bias (None if no bias was folded in).
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for t in self.model.tensors() {
            let d = PyDict::new(py);
            d.set_item("name", t.name())?;
            d.set_item("key", t.key())?;
            d.set_item("layout", t.layout())?;
            d.set_item("dtype", t.dtype())?;
            d.set_item("shape", t.shape().to_vec())?;
            d.set_item("offset", t.entry().offset)?;
            d.set_item("length", t.entry().length)?;
            d.set_item("blake3", &t.entry().blake3)?;
            d.set_item("bias", t.bias())?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// A read-only buffer over `length` bytes at `offset` of the mapping (no copy).
    fn view(&self, offset: usize, length: usize) -> PyResult<View> {
        let end = offset.checked_add(length).filter(|&e| e <= self.model.bytes().len());
        if end.is_none() {
            return Err(PyIndexError::new_err(format!(
                "bytes [{offset}, +{length}) lie outside the {}-byte segment",
                self.model.bytes().len()
            )));
        }
        Ok(View::new(Arc::clone(&self.model), offset, length))
    }

    /// Checks every entry's bytes against its BLAKE3; raises PackdError (CORRUPT) if one
    /// differs, (DIGESTS_PENDING) for a publication served before packd hashed it.
    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.model.verify()).map_err(|e| to_py(py, &e))
    }
}

/// Turns packd's adoption of the process's XNNPACK on (see `packd.executorch`) and returns
/// its status as a dict. Releases the GIL: the scan may load nothing but reads every loaded
/// object's tables.
#[pyfunction]
fn xnnpack_enable(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let status = py.detach(packd_xnnpack::adopt::enable);
    status_dict(py, &status)
}

/// What the adoption did so far, as a dict.
#[pyfunction]
fn xnnpack_status(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let status = py.detach(packd_xnnpack::adopt::status);
    status_dict(py, &status)
}

/// One model's weight cache for LiteRT (see `packd.litert`): the paths to give LiteRT, then
/// `_finish()` once it compiled the model (only `packd.litert` calls it), or
/// `abandon(error)` when it failed. Keep it as long as the compiled model: it holds packd's
/// lease and the fds LiteRT was given.
#[pyclass(frozen, module = "packd._native")]
struct LiteRtCache {
    path: String,
    model_path: Option<String>,
    identity: Option<String>,
    inner: std::sync::Mutex<packd_litert::WeightCache>,
}

impl LiteRtCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, packd_litert::WeightCache> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl LiteRtCache {
    /// The path for `CpuOptions.xnnpack_weight_cache_path` ("" when packd takes no part).
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// The path LiteRT is to read the model from (`/proc/self/fd/N` of the file packd
    /// hashed), or None (a model in memory, or packd takes no part).
    #[getter]
    fn model_path(&self) -> Option<&str> {
        self.model_path.as_deref()
    }

    /// The model's cache identity, once known.
    #[getter]
    fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// LiteRT compiled the model (call it before anything else sees the model): publishes a
    /// build, checks a served cache was mapped. Returns "served", "built" or "private".
    fn _finish(&self, py: Python<'_>) -> &'static str {
        py.detach(|| sys::finish_litert(&mut self.lock()).as_str())
    }

    /// LiteRT failed to compile the model with `error`: a builder gives its role up.
    fn abandon(&self, py: Python<'_>, error: &str) {
        py.detach(|| self.lock().abandon(error));
    }
}

/// Asks packd for the weight cache of `model` (a path, or the model's bytes). Waits while
/// another process builds it (the GIL released).
#[pyfunction]
fn litert_open(
    py: Python<'_>,
    model: &Bound<'_, PyAny>,
    xnnpack_flags: i64,
    kernel_mode: i64,
    accelerators: i64,
) -> PyResult<LiteRtCache> {
    let settings = packd_litert::Settings { xnnpack_flags, kernel_mode, accelerators };
    let cache = if let Ok(bytes) = model.cast::<pyo3::types::PyBytes>() {
        let bytes = bytes.as_bytes();
        py.detach(|| packd_litert::WeightCache::open(packd_litert::Model::Bytes(bytes), settings))
    } else {
        let path: PathBuf = model.extract()?;
        py.detach(|| packd_litert::WeightCache::open(packd_litert::Model::Path(&path), settings))
    };
    Ok(LiteRtCache {
        path: cache.path().to_string(),
        model_path: cache.model_path(),
        identity: cache.identity().map(str::to_string),
        inner: std::sync::Mutex::new(cache),
    })
}

/// Counts and reports a compile packd takes no part in, for `reason`; `engine_cache`: the
/// worker chose its own cache file. Returns the handle to keep with the model (its
/// connection shows the worker in `packctl clients`).
#[pyfunction]
fn litert_skip(py: Python<'_>, model: String, reason: &str, engine_cache: bool) -> LiteRtCache {
    let fallback = if engine_cache { packd_client::Fallback::EngineCache } else { packd_client::Fallback::Other };
    let cache = py.detach(|| packd_litert::WeightCache::skip(model, fallback, reason));
    LiteRtCache { path: String::new(), model_path: None, identity: None, inner: std::sync::Mutex::new(cache) }
}

/// What packd did for LiteRT in this process, as a dict (once the publications under way
/// ended; the GIL released meanwhile).
#[pyfunction]
fn litert_status(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let status = py.detach(packd_litert::status);
    status_dict(py, &status)
}

/// One session's share of packd for ONNX Runtime (see `packd.onnxruntime`): its role and
/// the paths to give ONNX Runtime; `finish_build()` once a builder's optimized model is
/// written, `served()` once the session over `model_path` is created, `abandon(error)` when
/// ONNX Runtime failed. Keep it as long as the session: it holds packd's lease.
#[pyclass(frozen, module = "packd._native")]
struct OrtShare {
    inner: std::sync::Mutex<packd_onnxruntime::Share>,
}

impl OrtShare {
    fn lock(&self) -> std::sync::MutexGuard<'_, packd_onnxruntime::Share> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl OrtShare {
    /// "build", "served" or "private".
    #[getter]
    fn role(&self) -> &'static str {
        self.lock().role().as_str()
    }

    /// A builder's `optimized_model_filepath`, else None.
    #[getter]
    fn build_model_path(&self) -> Option<PathBuf> {
        self.lock().build_model_path()
    }

    /// The model ONNX Runtime is to load when served, else None.
    #[getter]
    fn model_path(&self) -> Option<PathBuf> {
        self.lock().model_path()
    }

    /// The session's identity, once known.
    #[getter]
    fn identity(&self) -> Option<String> {
        self.lock().identity().map(str::to_string)
    }

    /// The optimized model was written: seals and publishes it. Returns the role now.
    fn finish_build(&self, py: Python<'_>) -> &'static str {
        py.detach(|| self.lock().finish_build().as_str())
    }

    /// The session over `model_path` was created: True when it maps packd's copy.
    fn served(&self, py: Python<'_>) -> bool {
        py.detach(|| self.lock().served())
    }

    /// ONNX Runtime failed with `error`: a builder gives its role up.
    fn abandon(&self, py: Python<'_>, error: &str) {
        py.detach(|| self.lock().abandon(error));
    }
}

/// Asks packd for the optimized form of `model` (a path, or the model's bytes) under
/// `options` (the session options that change it, as text). Waits while another process
/// builds it (the GIL released).
#[pyfunction]
fn onnxruntime_open(py: Python<'_>, model: &Bound<'_, PyAny>, options: &str) -> PyResult<OrtShare> {
    let share = if let Ok(bytes) = model.cast::<pyo3::types::PyBytes>() {
        let bytes = bytes.as_bytes();
        py.detach(|| packd_onnxruntime::Share::open(packd_onnxruntime::Model::Bytes(bytes), options))
    } else {
        let path: PathBuf = model.extract()?;
        py.detach(|| packd_onnxruntime::Share::open(packd_onnxruntime::Model::Path(&path), options))
    };
    Ok(OrtShare { inner: std::sync::Mutex::new(share) })
}

/// Counts and reports a session packd takes no part in, for `reason`; `engine_cache`: the
/// worker chose its own optimized model file. Returns the handle to keep with the session.
#[pyfunction]
fn onnxruntime_skip(py: Python<'_>, model: String, reason: &str, engine_cache: bool) -> OrtShare {
    let fallback = if engine_cache { packd_client::Fallback::EngineCache } else { packd_client::Fallback::Other };
    let share = py.detach(|| packd_onnxruntime::Share::skip(model, fallback, reason));
    OrtShare { inner: std::sync::Mutex::new(share) }
}

/// What packd did for ONNX Runtime in this process, as a dict (once the publications under
/// way ended; the GIL released meanwhile).
#[pyfunction]
fn onnxruntime_status(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let status = py.detach(packd_onnxruntime::status);
    status_dict(py, &status)
}

/// A status as Python values: its fields (by their serialised names) as a dict, maps as
/// dicts, lists as lists, absent values as None.
fn status_dict<'py>(py: Python<'py>, status: &impl serde::Serialize) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::to_value(status).map_err(|e| PyValueError::new_err(e.to_string()))?;
    value_to_py(py, &value)
}

fn value_to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(a) => {
            PyList::new(py, a.iter().map(|x| value_to_py(py, x)).collect::<PyResult<Vec<_>>>()?)?.into_any()
        }
        Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, value_to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// The native part of the `packd` package.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(xnnpack_enable, m)?)?;
    m.add_function(wrap_pyfunction!(xnnpack_status, m)?)?;
    m.add_function(wrap_pyfunction!(report_later, m)?)?;
    m.add_function(wrap_pyfunction!(litert_open, m)?)?;
    m.add_function(wrap_pyfunction!(litert_skip, m)?)?;
    m.add_function(wrap_pyfunction!(litert_status, m)?)?;
    m.add_class::<LiteRtCache>()?;
    m.add_function(wrap_pyfunction!(onnxruntime_open, m)?)?;
    m.add_function(wrap_pyfunction!(onnxruntime_skip, m)?)?;
    m.add_function(wrap_pyfunction!(onnxruntime_status, m)?)?;
    m.add_class::<OrtShare>()?;
    m.add("ONNXRUNTIME_KEYED_ENTRIES", pyo3::types::PyTuple::new(m.py(), packd_onnxruntime::KEYED_ENTRIES)?)?;
    m.add(
        "ONNXRUNTIME_BUILD_ENTRIES",
        pyo3::types::PyDict::from_sequence(
            &pyo3::types::PyList::new(m.py(), packd_onnxruntime::BUILD_ENTRIES)?.into_any(),
        )?,
    )?;
    m.add_class::<Client>()?;
    m.add_class::<Segment>()?;
    m.add_class::<View>()?;
    m.add("PackdError", m.py().get_type::<PackdError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
