"""packd as LiteRT's XNNPACK weight cache: one packed copy of a model's weights per host.

    import packd.litert
    packd.litert.enable()                  # before or after importing ai_edge_litert
    from ai_edge_litert.compiled_model import CompiledModel
    model = CompiledModel.from_file("model.tflite")
    print(packd.litert.status())           # served / built / private, and why

`enable()` wraps `CompiledModel.from_file` and `CompiledModel.from_buffer` (LiteRT's
`ai-edge-litert` 2.3 from PyPI). Each compile on the CPU asks packd for the model's weight
cache, identified by the model's bytes, LiteRT's build (XNNPACK is linked into it), the CPU
and the `CpuOptions` that choose kernels, and passes LiteRT a path as
`CpuOptions.xnnpack_weight_cache_path`:

- the cache is published: the path names the sealed memfd packd serves; LiteRT maps it
  read-only and packs nothing (every worker maps the same pages);
- nobody built it yet: this worker builds it into memory of its own, which packd seals and
  publishes once the compile returns (the worker keeps using those very pages);
- another worker is building it: this one waits for the publication, or builds privately
  when what is left of that build would take longer than building itself;
- anything else (packd away, a worker that set its own `xnnpack_weight_cache_path`, YNNPACK
  asked for, no CPU accelerator, `PACKD_LITERT=off`): LiteRT compiles exactly as without
  packd, and `status()["reasons"]` says why (also said once on stderr, and reported to
  packd, which counts it; with `PACKD_LITERT=off` packd is not contacted at all).

The compiled model keeps packd's lease on its cache (as `model._packd_litert`) while it lives.
`PACKD_SOCKET_DIR` says where packd listens (default `/run/packd`). docs/INTEGRATION.md,
"LiteRT", tells how it works and its limits.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import os
import threading
from typing import Any, Dict

from . import _native

__all__ = ["enable", "status"]

_ORIGINAL: Dict[str, Any] = {}
_LOCK = threading.Lock()


def enable() -> Dict[str, Any]:
    """Turn packd on for LiteRT's `CompiledModel` in this process (idempotent); returns
    `status()`. Imports `ai_edge_litert.compiled_model` (ImportError when LiteRT is not
    installed)."""
    from ai_edge_litert import compiled_model

    cls = compiled_model.CompiledModel
    with _LOCK:
        if not _ORIGINAL:
            for name, from_file in (("from_file", True), ("from_buffer", False)):
                original = getattr(cls, name).__func__
                _ORIGINAL[name] = original
                setattr(cls, name, classmethod(_wrap(original, compiled_model, from_file)))
    out = status()
    out["enabled"] = True
    return out


def status() -> Dict[str, Any]:
    """What packd did for LiteRT in this process (once the publications under way ended).

    Keys: ``enabled``; ``models`` (compiles packd was asked about), of which ``served``
    (LiteRT mapped packd's cache and packed nothing), ``built`` (this process built the
    cache and packd published it) and ``private`` (compiled as without packd), with
    ``reasons`` (reason -> count) and ``fallbacks`` (the same by packd's reason names);
    ``bytes_shared`` (bytes of caches mapped from packd: served, or built and published);
    ``bytes_private``; ``libraries`` (LiteRT's libraries and the digests naming their
    build) and ``engine`` (the first of them); ``identity`` (the last model's cache identity); and the
    time spent, in microseconds: ``identify_us`` (naming the model and LiteRT), ``acquire_us``
    (asking packd, with waiting for another worker's build), ``publish_us`` (sealing the
    build, and packd's answer to its publication).
    """
    out = _native.litert_status()
    out["enabled"] = bool(_ORIGINAL)
    return out


def _wrap(original, compiled_model, from_file):
    signature = inspect.signature(original)
    first = list(signature.parameters)[1]  # model_path / model_data

    @functools.wraps(original)
    def compile_through_packd(cls, *args, **kwargs):
        try:
            bound = signature.bind(cls, *args, **kwargs)
            bound.apply_defaults()
            resolved = compiled_model._resolve_options(bound.arguments.get("options"),
                                                       bound.arguments.get("hardware_accel"))
        except (TypeError, ValueError, AttributeError):
            return original(cls, *args, **kwargs)  # LiteRT says what is wrong
        model = bound.arguments[first]
        if from_file:
            try:
                model = os.fsdecode(os.fspath(model))
            except TypeError:
                return original(cls, *args, **kwargs)
            name = model
        else:
            name = f"a model of {len(model)} bytes in memory"
        cpu = resolved._cpu_options if resolved._cpu_options is not None else compiled_model.CpuOptions()
        skip = _skip_reason(resolved, cpu, compiled_model)
        if skip is not None:
            handle = _native.litert_skip(name, skip[0], skip[1])
            compiled = original(cls, *args, **kwargs)
            compiled._packd_litert = handle
            return compiled
        cache = _native.litert_open(
            model if from_file else bytes(model),
            -1 if cpu.xnnpack_flags is None else int(cpu.xnnpack_flags),
            -1 if cpu.kernel_mode is None else int(cpu.kernel_mode),
            int(resolved.hardware_accelerators),
        )
        if not cache.path:
            compiled = original(cls, *args, **kwargs)
            compiled._packd_litert = cache
            return compiled
        ours = copy.copy(resolved)
        ours._cpu_options = dataclasses.replace(cpu, xnnpack_weight_cache_path=cache.path)
        bound.arguments["options"] = ours
        bound.arguments["hardware_accel"] = None
        if cache.model_path is not None:
            bound.arguments[first] = cache.model_path  # the very file packd hashed
        try:
            compiled = original(*bound.args, **bound.kwargs)
        except BaseException as e:
            cache.abandon(str(e) or type(e).__name__)
            raise
        cache._finish()
        compiled._packd_litert = cache
        return compiled

    return compile_through_packd


def _skip_reason(options, cpu, compiled_model):
    """Why packd leaves this compile alone (reason, whether the worker chose its own cache),
    or None."""
    accel = options.hardware_accelerators
    if not int(accel) & int(compiled_model.HardwareAccelerator.CPU):
        return (f"the model is compiled for {accel}, not the CPU", False)
    if cpu.xnnpack_weight_cache_path:
        return (f"the worker set its own xnnpack_weight_cache_path ({cpu.xnnpack_weight_cache_path})", True)
    if cpu.enable_ynnpack:
        return ("YNNPACK was asked for (enable_ynnpack): the operations it takes ignore XNNPACK's weight cache",
                False)
    return None
