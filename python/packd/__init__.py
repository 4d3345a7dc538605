"""packd for Python: map model weights that packd packed once per host.

    import packd
    weights = packd.load_file("model.safetensors")        # like safetensors.numpy.load_file

    with packd.Client() as client:                        # or packd.Client("/run/packd")
        model = client.pack("model.safetensors", layout="f32-gemm:nr=16,kr=1,sr=1")
        q = model.tensor("encoder.layer.0.attention.self.query.weight")

Arrays are read-only views of the shared, sealed mapping: no byte is copied, writing raises,
and the mapping (with its lease) stays alive while any array from it is alive.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator, Mapping, NamedTuple, Optional, Union

import numpy as np

from ._native import Client as _NativeClient
from ._native import PackdError, Segment as _Segment
from ._native import __version__
from . import _native

__all__ = ["Client", "Model", "Entry", "PackdError", "load_file", "report_later", "__version__"]


def __dir__() -> list:
    """The public names only (not the modules this one imports)."""
    return sorted(__all__)

# Element types of identity entries (the source dtype); BF16 has no NumPy type and is
# returned as its raw 16-bit patterns (uint16).
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
# Element types of GEMM layouts, whose packed bytes come as a 1-D array.
_GEMM = {"f32-gemm": np.float32, "f16-gemm": np.float16, "bf16-gemm": np.uint16, "qc8w-gemm": np.uint8}


class Entry(NamedTuple):
    """One packed tensor: where its bytes lie in the segment and what they are."""

    name: str
    key: str
    layout: str
    dtype: str
    shape: tuple
    offset: int
    length: int
    blake3: str
    bias: Optional[str]


class Model:
    """A mapped model. `tensor(name)` gives a read-only NumPy array over the shared mapping;
    `release()` (or leaving a `with` block) drops this handle — the mapping and its lease
    end when the last array from it is gone too."""

    def __init__(self, segment: _Segment):
        self._segment: Optional[_Segment] = segment
        self._key = segment.key
        self._entries = [Entry(**{**e, "shape": tuple(e["shape"])}) for e in segment.entries()]
        self._by_name = {e.name: e for e in self._entries}
        self._publisher = segment.publisher()

    @property
    def key(self) -> str:
        """The segment key."""
        return self._key

    @property
    def entries(self) -> list:
        """The entries in source order."""
        return list(self._entries)

    @property
    def publisher(self) -> Optional[dict]:
        """For a segment an engine published (docs/PROTOCOL.md, "acquire and publish"): its
        publisher's uid, gid, groups and the cache identity. None for a segment packd packed.
        Its entries have layout "engine": `tensor()` gives their bytes as a 1-D uint8 array."""
        return None if self._publisher is None else dict(self._publisher)

    def names(self) -> list:
        """The tensor names, in source order."""
        return [e.name for e in self._entries]

    def _live(self) -> _Segment:
        if self._segment is None:
            raise ValueError(f"model {self._key} was released")
        return self._segment

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name` as a read-only array viewing the mapping. An identity entry has
        its dtype and shape; a GEMM entry is the packed bytes as a 1-D array of the layout's
        element type (see docs/LAYOUTS.md)."""
        e = self._by_name.get(name)
        if e is None:
            owner = next((o for o in self._entries if o.bias == name), None)
            if owner is not None:
                raise KeyError(f"{name!r} has no entry of its own: it is folded into the entry of {owner.name!r} "
                               f"({owner.layout}); pack with layout='identity', or a rule "
                               f"'{owner.name}=identity' (a rule naming the bias has no effect: "
                               f"folding wins), to get it as is")
            raise KeyError(f"model {self._key} has no tensor named {name!r}")
        view = self._live().view(e.offset, e.length)
        kind = e.layout.split(":", 1)[0]
        if kind == "identity":
            dtype = _DTYPES.get(e.dtype)
            if dtype is None:
                raise TypeError(f"tensor {name!r} has dtype {e.dtype}, which NumPy cannot view")
            arr = np.frombuffer(view, dtype=np.dtype(dtype).newbyteorder("<"))
            return arr.reshape(e.shape)
        return np.frombuffer(view, dtype=np.dtype(_GEMM.get(kind, np.uint8)).newbyteorder("<"))

    def arrays(self) -> dict:
        """Every tensor by name (see `tensor`)."""
        return {e.name: self.tensor(e.name) for e in self._entries}

    def verify(self) -> None:
        """Checks every entry's bytes against its BLAKE3 (raises PackdError CORRUPT; DIGESTS_PENDING
        for a publication served before packd hashed it: get it again later)."""
        self._live().verify()

    @property
    def address(self) -> int:
        """Address of the mapping's first byte."""
        return self._live().address

    @property
    def size(self) -> int:
        """Size of the mapping in bytes."""
        return self._live().size

    def release(self) -> None:
        """Drops this handle; arrays already taken keep the mapping alive."""
        self._segment = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        state = "released" if self._segment is None else f"{len(self._entries)} entries"
        return f"<packd.Model {self._key} ({state})>"


class Client:
    """A connection to packd. Share it between threads freely: calls release the GIL, and
    releasing a model never waits for another thread's call.

    Every call has deadlines (seconds): `connect_timeout` for connecting (default 5),
    `timeout` for the daemon's silence on any call (default 30; a running pack reports its
    progress every second), `pack_timeout` for a whole pack (default 86400). A daemon that
    does not answer in time raises PackdError with code "TIMEOUT"."""

    def __init__(self, socket_dir: Union[str, os.PathLike, None] = None, *,
                 timeout: Optional[float] = None, pack_timeout: Optional[float] = None,
                 connect_timeout: Optional[float] = None):
        self._native = _NativeClient(None if socket_dir is None else os.fspath(socket_dir),
                                     timeout=timeout, pack_timeout=pack_timeout,
                                     connect_timeout=connect_timeout)

    def pack(self, source: Union[str, os.PathLike, int], layout: Optional[str] = None,
             rules: Iterable[str] = (), progress=None) -> Model:
        """Packs a safetensors file (a path, or an open file descriptor the caller keeps),
        or finds it packed, and maps it. `layout` is the default GEMM rule's layout
        (None: f32-gemm:nr=16,kr=1,sr=1; "identity": every tensor as in the file);
        `rules` are "GLOB=LAYOUT" rules tried first. `progress`, if given, is called as
        `progress(stage, bytes_done, bytes_total)` while the daemon packs (stage is
        "accepted", "waiting", "hashing" or "packing"): "accepted" at once, even for a model
        found packed, then at least once a second while it packs; bytes_total is the source
        file's size while hashing or packing, 0 otherwise."""
        if isinstance(source, bool):
            raise TypeError("source must be a path or an open file descriptor (int), not a bool")
        if not isinstance(source, int):
            source = os.fspath(source)
        if progress is not None and not callable(progress):
            raise TypeError("progress must be callable as progress(stage, bytes_done, bytes_total)")
        if isinstance(rules, (str, bytes)):
            raise TypeError(f"rules must be a list of 'GLOB=LAYOUT' strings, not one string: [{rules!r}]")
        return Model(self._open().pack(source, layout, list(rules), progress))

    def get(self, key: str) -> Model:
        """Maps what is already packed, by segment key or entry key."""
        return Model(self._open().get(key))

    def _open(self):
        if self._native is None:
            raise ValueError("this Client is closed: make a new one")
        return self._native

    def report(self, engine: str, model: str, obtained: str, reason: Optional[str] = None,
               detail: str = "", private_bytes: int = 0, shared_bytes: int = 0) -> None:
        """Tells packd how this worker obtained `model`'s weights, so that operators see it
        (`packctl clients`, `packctl top`, the metrics): `obtained` is "served", "built" or
        "private"; a private report needs a `reason` ("daemon_away", "unknown_interface",
        "unnamed_weights", "over_quota", "build_timeout", "builder_gave_up", "build_limit",
        "publish_refused", "engine_cache", "asked", "worker_error", "build_slow", "unshared_buffer_type" or "other"). `engine`
        names your engine; `model` the model (its cache identity when it has one). Not
        answered; kept and sent again after a reconnect. Raises ValueError for an unknown
        `obtained` or `reason`."""
        self._open().report(engine, model, obtained, reason, detail, private_bytes, shared_bytes)

    def close(self) -> None:
        """Closes this client: later calls raise ValueError. Its connection is closed once no
        model from it is alive any more (the models stay mapped and leased until dropped)."""
        self._native = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def report_later(engine: str, model: str, reason: str, detail: str = "", private_bytes: int = 0) -> bool:
    """Keeps a private report made while packd cannot be reached (no Client could connect;
    `reason` usually "daemon_away"): the next Client of this process that connects sends
    it. Returns False when it was not kept (64 others wait already)."""
    return _native.report_later(engine, model, reason, detail, private_bytes)


def load_file(path: Union[str, os.PathLike], socket_dir: Union[str, os.PathLike, None] = None) -> Mapping[str, np.ndarray]:
    """A drop-in for `safetensors.numpy.load_file`: `{name: array}` with every tensor as in
    the file (identity layout), each a read-only view of packd's shared copy.

    The identity plan is its own segment: a process that also packs the same file with a
    GEMM layout maps two segments (about the file's size each, shared host-wide). A missing
    or unreadable file raises FileNotFoundError / PermissionError (OSError, with errno)."""
    model = Client(socket_dir).pack(path, layout="identity")
    return model.arrays()
