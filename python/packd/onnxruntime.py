"""packd for ONNX Runtime: one copy per host of a model's weights and MLAS's prepacked weights.

    import packd.onnxruntime
    packd.onnxruntime.enable()             # before or after importing onnxruntime
    import onnxruntime as ort
    session = ort.InferenceSession("model.onnx", providers=["CPUExecutionProvider"])
    print(packd.onnxruntime.status())      # served / built / private, and why

`enable()` wraps `onnxruntime.InferenceSession` (ONNX Runtime 1.32 from PyPI). Each session on
the CPU execution provider, from a path or from bytes, asks packd for the model's optimized
form, identified by the model's bytes (and its external data files), ONNX Runtime's build, the
CPU and the session options that change optimization or prepacking:

- nobody built it yet: this worker has ONNX Runtime write the optimized model, its weights and
  the blobs MLAS prepacked into memory packd seals and publishes (nothing is left on disk), then
  creates its session over that sealed copy;
- it is published: the session maps packd's copy and prepacks nothing (every worker maps the
  same pages);
- another worker is building it: this one waits for the publication, bounded as packd's other
  adapters wait;
- anything else (packd away, another execution provider, an ORT-format model, initializers or
  custom operators given in the session options, the worker's own `optimized_model_filepath`,
  `PACKD_ONNXRUNTIME=off`): ONNX Runtime creates the session exactly as without packd, and
  `status()["reasons"]` says why (also said once on stderr, and reported to packd, which counts
  it; with `PACKD_ONNXRUNTIME=off` packd is not contacted at all).

Call `enable()` before configuring `SessionOptions`: packd sees free dimension overrides and
initializers given to options through the methods it wraps from then on (options configured
earlier are read only through ONNX Runtime's getters). The session keeps packd's lease on its
copy (as `session._packd_onnxruntime`) while it lives.
`PACKD_SOCKET_DIR` says where packd listens (default `/run/packd`). docs/INTEGRATION.md, "ONNX
Runtime", tells how it works and its limits.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from typing import Any, Dict

from . import _native

__all__ = ["enable", "status"]

_ORIGINAL: Dict[str, Any] = {}
_LOCK = threading.Lock()
# What a worker did to its SessionOptions that packd cannot see through ONNX Runtime's API.
_TOUCHED: "weakref.WeakKeyDictionary[Any, Dict[str, Any]]" = weakref.WeakKeyDictionary()

# Session config entries that change the optimized model or the prepacked weights: their
# values name the copy. (Entries that only change how a session runs are left out.)
KEYED_ENTRIES = _native.ONNXRUNTIME_KEYED_ENTRIES

# The entries packd sets on a builder's SessionOptions to have the optimized model written with
# its weights and prepacked blobs as external data.
_BUILD_ENTRIES = _native.ONNXRUNTIME_BUILD_ENTRIES

# SessionOptions methods whose effect packd cannot read back: (name, reason or None when the
# call is recorded in the identity instead).
_WATCHED = {
    "add_initializer": "initializers given in the session options (add_initializer)",
    "add_external_initializers": "initializers given in the session options (add_external_initializers)",
    "add_external_initializers_from_files_in_memory":
        "external data given in memory (add_external_initializers_from_files_in_memory)",
    "register_custom_ops_library": "a custom operator library (register_custom_ops_library)",
    "add_provider": "an execution provider added to the session options (add_provider)",
    "add_provider_for_devices": "an execution provider added to the session options (add_provider_for_devices)",
    "set_ep_context_data_read_func": "an EP context reader in the session options",
    "add_free_dimension_override_by_name": None,
    "add_free_dimension_override_by_denotation": None,
}


def enable() -> Dict[str, Any]:
    """Turn packd on for ONNX Runtime's `InferenceSession` in this process (idempotent);
    returns `status()`. Imports `onnxruntime` (ImportError when it is not installed)."""
    import onnxruntime

    with _LOCK:
        if not _ORIGINAL:
            cls = onnxruntime.InferenceSession
            original = cls.__init__
            _ORIGINAL["__init__"] = original
            options = onnxruntime.SessionOptions
            for name in _WATCHED:
                method = getattr(options, name, None)
                if method is not None:
                    _ORIGINAL["SessionOptions." + name] = method
                    setattr(options, name, _watch(name, method))
            cls.__init__ = _wrap(original, onnxruntime)
    out = status()
    out["enabled"] = True
    return out


def status() -> Dict[str, Any]:
    """What packd did for ONNX Runtime in this process (once the publications under way ended).

    Keys: ``enabled``; ``sessions`` (sessions packd was asked about), of which ``served`` (the
    session maps packd's copy and prepacked nothing), ``built`` (this process had ONNX Runtime
    write the optimized model and packd published it) and ``private`` (created as without
    packd), with ``reasons`` (reason -> count) and ``fallbacks`` (the same by packd's reason
    names); ``bytes_shared`` (bytes of packd's copies mapped); ``bytes_private``; ``libraries``
    (ONNX Runtime's library and the build that names it) and ``engine`` (the first of them);
    ``identity`` (the last session's identity); and the time spent, in microseconds:
    ``identify_us`` (naming the model and ONNX Runtime), ``acquire_us`` (asking packd, with
    waiting for another worker's build), ``publish_us`` (sealing the build, and packd's answer
    to its publication).
    """
    out = _native.onnxruntime_status()
    out["enabled"] = bool(_ORIGINAL)
    return out


def _watch(name, method):
    @functools.wraps(method)
    def watched(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        try:
            _TOUCHED.setdefault(self, {}).setdefault(name, []).append((args, kwargs))
        except TypeError:
            pass
        return result

    return watched


def _entry(options, key):
    try:
        return options.get_session_config_entry(key)
    except (RuntimeError, TypeError):
        return None


def _provider_names(providers):
    return [p[0] if isinstance(p, tuple) else p for p in providers]


def _skip_reason(ort, model, options, providers, kwargs):
    """Why packd leaves this session alone (reason, whether the worker chose its own optimized
    model), or None."""
    if providers is not None:
        others = [p for p in _provider_names(providers) if p != "CPUExecutionProvider"]
        if others:
            return (f"another execution provider ({', '.join(map(str, others))})", False)
    else:
        others = [p for p in ort.get_available_providers()
                  if p not in ("CPUExecutionProvider", "AzureExecutionProvider")]
        if others:
            return (f"no providers given while this ONNX Runtime has {', '.join(others)}", False)
    if isinstance(model, bytes):
        if model[4:8] == b"ORTM":
            return ("an ORT-format model (packd shares ONNX models)", False)
    elif model.endswith(".ort"):
        return ("an ORT-format model (packd shares ONNX models)", False)
    if kwargs.get("read_config_from_model") or os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL") == "1":
        return ("session options read from the model (read_config_from_model)", False)
    if options is None:
        return None
    if _entry(options, "session.load_model_format") == "ORT":
        return ("an ORT-format model (packd shares ONNX models)", False)
    if options.optimized_model_filepath:
        return (f"the worker writes its own optimized model ({options.optimized_model_filepath})", True)
    for key, ours in _BUILD_ENTRIES.items():
        value = _entry(options, key)
        if value is not None and value != ours:
            return (f"the worker set {key} ({value})", True)
    if _entry(options, "session.save_model_format") == "ORT":
        return ("session.save_model_format is ORT", False)
    if _entry(options, "ep.context_enable") == "1":
        return ("EP context models (ep.context_enable)", False)
    if options.has_providers():
        return ("an execution provider added to the session options", False)
    for name in _TOUCHED.get(options, {}):
        if _WATCHED.get(name):
            return (_WATCHED[name], False)
    return None


def _identity_options(options, kwargs):
    """The session options that change the optimized model or its prepacks, as text."""
    parts = []
    if options is not None:
        parts.append(f"level={int(options.graph_optimization_level)}")
        for key in KEYED_ENTRIES:
            value = _entry(options, key)
            if value is not None:
                parts.append(f"{key}={value}")
        for name, calls in sorted(_TOUCHED.get(options, {}).items()):
            if _WATCHED.get(name) is None:
                parts.append(f"{name}={[(list(map(repr, a)), sorted(k.items())) for a, k in calls]}")
    else:
        parts.append("level=default")
    disabled = kwargs.get("disabled_optimizers")
    if disabled:
        parts.append(f"disabled_optimizers={sorted(map(str, disabled))}")
    return "\n".join(parts)


def _wrap(original, ort):
    @functools.wraps(original)
    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
        def alone():
            return original(self, path_or_bytes, sess_options, providers, provider_options, **kwargs)

        # ONNX Runtime takes a path (str or os.PathLike) or bytes; anything else is its to refuse.
        is_bytes = isinstance(path_or_bytes, bytes)
        try:
            model = path_or_bytes if is_bytes else os.fsdecode(os.fspath(path_or_bytes))
        except TypeError:
            return alone()
        share = None
        try:
            share = _through_packd(self, original, ort, model, is_bytes, path_or_bytes, sess_options, providers,
                                   provider_options, kwargs)
        except Exception as e:  # noqa: BLE001 - packd's part failed: ONNX Runtime alone
            if share is not None:
                share.abandon(f"{type(e).__name__}: {e}")
            else:
                share = _native.onnxruntime_skip(
                    f"a model of {len(model)} bytes in memory" if is_bytes else model,
                    f"packd's wrapper failed ({type(e).__name__}: {e})", False)
        if share is None or not getattr(self, "_packd_onnxruntime_done", False):
            alone()
        self._packd_onnxruntime = share
        return None

    return __init__


def _through_packd(self, original, ort, model, is_bytes, path_or_bytes, sess_options, providers, provider_options,
                   kwargs):
    """Creates the session over packd's copy when it can (then sets `_packd_onnxruntime_done`);
    returns the share, whose role says what happened."""
    name = f"a model of {len(model)} bytes in memory" if is_bytes else model
    skip = _skip_reason(ort, model, sess_options, providers, kwargs)
    if skip is not None:
        return _native.onnxruntime_skip(name, skip[0], skip[1])
    share = _native.onnxruntime_open(model, _identity_options(sess_options, kwargs))
    if share.role == "build":
        try:
            _build(original, ort, share, path_or_bytes, sess_options, providers, provider_options, kwargs)
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's words; it says them again alone
            share.abandon(f"{type(e).__name__}: {e}")
            return share
        # The build's session is gone: its private weights and prepacks are given back before
        # this worker maps the sealed copy.
        share.finish_build()
    if share.role == "served":
        try:
            original(self, os.fspath(share.model_path), sess_options, providers, provider_options, **kwargs)
        except Exception as e:  # noqa: BLE001 - counted; the session is created alone
            share.abandon(f"{type(e).__name__}: {e}")
            return share
        if share.served():
            # A session ONNX Runtime creates again (set_providers) reads the user's model.
            self._model_path, self._model_bytes = (None, model) if is_bytes else (model, None)
            self._packd_onnxruntime_done = True
    return share


# SessionOptions attributes a builder's own options copy from the worker's.
_COPIED = ("graph_optimization_level", "execution_mode", "execution_order", "use_deterministic_compute",
           "intra_op_num_threads", "inter_op_num_threads", "log_verbosity_level", "logid")


def _build_options(ort, options, share):
    """Options for the build: what changes the optimized model copied from the worker's
    (whose own options are left as they are), and the entries that have ONNX Runtime write it
    with its weights and prepacks as external data into packd's build."""
    ours = ort.SessionOptions()
    if options is not None:
        for attr in _COPIED:
            setattr(ours, attr, getattr(options, attr))
        for key in KEYED_ENTRIES:
            value = _entry(options, key)
            if value is not None:
                ours.add_session_config_entry(key, value)
        for name, calls in _TOUCHED.get(options, {}).items():
            if _WATCHED.get(name) is None:
                for args, kwargs in calls:
                    getattr(ours, name)(*args, **kwargs)
    ours.optimized_model_filepath = os.fspath(share.build_model_path)
    for key, value in _BUILD_ENTRIES.items():
        ours.add_session_config_entry(key, value)
    # ONNX Runtime warns that an optimized model may hold CPU-specific layouts: packd's
    # identity names the CPU.
    ours.log_severity_level = 3
    return ours


def _build(original, ort, share, path_or_bytes, sess_options, providers, provider_options, kwargs):
    """Has ONNX Runtime write the optimized model with its weights and prepacks as external
    data into packd's build (the session it creates for that is dropped)."""
    options = _build_options(ort, sess_options, share)
    scratch = ort.InferenceSession.__new__(ort.InferenceSession)
    original(scratch, path_or_bytes, options, providers, provider_options, **kwargs)
    del scratch
