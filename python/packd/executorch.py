"""packd as the weights cache of ExecuTorch's XNNPACK backend, with nothing rebuilt.

    import packd.executorch
    packd.executorch.enable()              # before or after importing executorch
    from executorch.runtime import Runtime
    method = Runtime.get().load_program("model.pte").load_method("forward")
    print(packd.executorch.status())       # served / built / private, and why

The first worker on the host packs the weights of each XNNPACK-delegated partition into
memory packd then seals and shares; every later worker maps them and packs nothing. It works
for any engine in the process that exports XNNPACK's C API (ExecuTorch's PyPI wheel does),
and changes nothing when sharing is not possible: packd away, an XNNPACK whose weights-cache
interface packd does not know, an engine that brought its own weights cache — the worker runs
as without packd, and `status()["reasons"]` says why (also logged once to stderr).

`PACKD_SOCKET_DIR` says where packd listens (default `/run/packd`). docs/INTEGRATION.md,
"ExecuTorch", tells how it works and its limits.
"""

from __future__ import annotations

from typing import Any, Dict

from . import _native

__all__ = ["enable", "status"]


def enable() -> Dict[str, Any]:
    """Turn packd on for XNNPACK in this process (idempotent) and return `status()`.

    Finds the loaded library that defines XNNPACK (importing ExecuTorch's runtime, which
    loads it, when no library does yet) and routes its runtime creation through packd.
    """
    status = _native.xnnpack_enable()
    if status["engine"] is None and status["interface_error"] is None:
        try:
            import executorch.extension.pybindings.portable_lib  # noqa: F401  (loads XNNPACK)
        except ImportError:
            return status
        status = _native.xnnpack_enable()
    return status


def status() -> Dict[str, Any]:
    """What packd did for XNNPACK in this process.

    Keys: ``enabled``; ``engine`` (the library defining XNNPACK) and ``interface`` (its
    weights-cache interface, e.g. 202603, or ``interface_error``); ``hooked`` (the objects
    whose calls go through packd); ``runtimes`` created, of which ``served`` (packed weights
    mapped from packd), ``built`` (packed here and published, or being published: a
    build packd refuses turns ``private`` once its ``publish_us`` is counted) and ``private``
    (as without packd) with ``reasons`` (reason → count) and ``fallbacks``; ``bytes_shared`` (weights
    mapped from packd) and ``bytes_private``; ``live`` runtimes; ``tensors_named``,
    ``bytes_hashed``, ``tensors_remembered`` (names taken from the per-user memo instead of
    hashing), ``tensors_provisional`` (named by the ``.pte``'s identity and their place: built
    under those names while hashed beside the build, or served and renamed by the builder's
    table) and ``tensors_unknown`` (datatypes packd does not size: packed privately); the
    caches' ``hits``, ``misses``, ``reserve_space`` and ``bytes_packed`` (bytes XNNPACK packed
    through packd's cache in this process; runtimes created without it count nothing here,
    so read ``served``/``built``/``private`` to know what happened); and the time spent, in
    microseconds: ``hash_us`` (before the build), ``hash_beside_us`` (beside it),
    ``acquire_us`` (asking packd, waiting for another process's build), ``create_us`` (XNNPACK's runtime creation), ``finalize_us`` (renaming a build,
    handing it to a thread of its own) and ``publish_us`` (on that thread: the build made
    read-only and sealed, then published, to packd's answer).

    ``PACKD_XNNPACK=off`` in the environment turns packd off for the process (``enable()``
    then does nothing).
    """
    return _native.xnnpack_status()
