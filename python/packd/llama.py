"""packd as the host's store of llama.cpp's repacked weights, for llama-cpp-python, with one line.

    import packd.llama
    packd.llama.enable()                   # before or after importing llama_cpp
    from llama_cpp import Llama
    llm = Llama(model_path="model.gguf")
    print(packd.llama.status())            # served / built / private, and why

llama.cpp's CPU backend repacks quantised weights at load (its ``CPU_REPACK`` buffer) into
private memory in every process. With packd on, the first worker on the host repacks and
publishes the result; every later worker maps that copy read-only and repacks nothing, with
bit-identical results. ``enable()`` loads ``libpackd_llama.so`` (what ``LD_PRELOAD`` would
load) into the process: it takes over the llama.cpp already loaded and any loaded later.

It changes nothing when sharing is not possible: packd away, a llama.cpp whose ggml version
packd-llama does not support (docs/INTEGRATION.md lists the versions), weights not read from
a mapped file (``use_mmap=False``) — the worker repacks as without packd, and
``status()["unsupported"]`` or ``status()["reasons"]`` says why.

The library is ``PACKD_LLAMA_LIB`` when it is set (that path only); else it is looked for in
``PREFIX/lib`` for the ``packd`` on ``PATH`` at ``PREFIX/bin/packd`` (as ``./install.sh``
installs them), then in ``~/.local/lib``, ``/usr/local/lib`` and the dynamic linker's paths. ``PACKD_SOCKET_DIR`` says where packd listens (default ``/run/packd``);
``PACKD_LLAMA=off`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import pathlib
import shutil
from typing import Any, Dict, List, Optional

__all__ = ["enable", "status", "library"]

_NAME = "libpackd_llama.so"
_lib: Optional[ctypes.CDLL] = None
_path: Optional[str] = None


def _loaded() -> Optional[str]:
    """The path of libpackd_llama.so if this process has it loaded already (LD_PRELOAD)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.endswith("/" + _NAME):
                    return path
    except OSError:
        pass
    return None


def _candidates() -> List[pathlib.Path]:
    places = []
    if os.environ.get("PACKD_LLAMA_LIB"):
        places.append(pathlib.Path(os.environ["PACKD_LLAMA_LIB"]))
        return places
    packd = shutil.which("packd")
    if packd:
        places.append(pathlib.Path(packd).resolve().parent.parent / "lib" / _NAME)
    places += [pathlib.Path.home() / ".local" / "lib" / _NAME, pathlib.Path("/usr/local/lib") / _NAME]
    return places


def library() -> str:
    """The path of the ``libpackd_llama.so`` ``enable()`` loads (see the module's docs).

    Raises ``FileNotFoundError`` naming the places looked at when there is none.
    """
    if _path:
        return _path
    loaded = _loaded()
    if loaded:
        return loaded
    places = _candidates()
    for p in places:
        if p.is_file():
            return str(p)
    if not os.environ.get("PACKD_LLAMA_LIB"):
        found = ctypes.util.find_library("packd_llama")
        if found:
            return found
    looked = ", ".join(str(p) for p in places)
    raise FileNotFoundError(
        f"packd.llama: no {_NAME} (looked at {looked}"
        + ("" if os.environ.get("PACKD_LLAMA_LIB") else " and the dynamic linker's paths")
        + "): install packd with ./install.sh, or set PACKD_LLAMA_LIB to the library's path"
    )


def enable(lib: Optional[str] = None) -> Dict[str, Any]:
    """Turn packd on for llama.cpp in this process (idempotent) and return ``status()``.

    Loads ``libpackd_llama.so`` (``lib``, else ``library()``) into the global scope, where a
    llama.cpp loaded later (``import llama_cpp``) binds its allocations to it, and takes over
    the llama.cpp already loaded. Raises ``FileNotFoundError`` when there is no library, and
    ``OSError`` when it cannot be loaded.
    """
    handle = _open(lib or library())
    handle.packd_llama_enable()
    return status()


def _open(path: str) -> ctypes.CDLL:
    global _lib, _path
    if _lib is None:
        handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        handle.packd_llama_status.restype = ctypes.c_size_t
        handle.packd_llama_status.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        handle.packd_llama_enable.restype = None
        handle.packd_llama_enable.argtypes = []
        _lib, _path = handle, path
    return _lib


def status() -> Dict[str, Any]:
    """What packd did for llama.cpp in this process.

    Keys (those of ``PACKD_LLAMA_STATUS``'s line, docs/INTEGRATION.md): ``enabled``;
    ``engine`` (the library defining ggml; also under its old key ``ggml``) and
    ``ggml_version``; ``unsupported`` (why nothing is hooked, e.g. a ggml version outside
    the supported ones); ``hooked`` (the objects whose allocations go through packd);
    ``buffers`` (CPU_REPACK buffers), of which ``served`` (mapped from packd: nothing
    repacked), ``built`` (repacked here, then shared; its old key ``published`` is written
    too until 0.3) and ``private`` (as without packd) with ``reasons`` (reason
    → count) and ``fallbacks``;
    ``tensors_repacked``, ``tensors_served`` and ``types`` (the buffers' tensors by ggml
    type); ``bytes_shared``, ``bytes_private``; the model's digest (``models_hashed``,
    ``models_remembered``, ``models_from_daemon``, and ``models_provisional``: named by the
    file's identity while its digest was found beside the build), ``identity``, and times
    in microseconds.
    Also ``library``: the path loaded, or ``None`` before ``enable()`` (without
    ``LD_PRELOAD``).
    """
    if _lib is None:
        preloaded = _loaded()
        if preloaded is None:
            return {"enabled": False, "library": None}
        _open(preloaded)
    assert _lib is not None
    size = _lib.packd_llama_status(None, 0) + 1
    while True:
        buf = ctypes.create_string_buffer(size)
        whole = _lib.packd_llama_status(buf, size)
        if whole < size:
            break
        size = whole + 1  # it grew meanwhile (a publication finished)
    out = json.loads(buf.value.decode())
    out["library"] = _path
    return out
