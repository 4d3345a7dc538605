"""Type stubs of packd._native (the Rust extension under the `packd` package)."""

import os
from typing import Optional, Union

__version__: str

class PackdError(Exception):
    """A packd call failed."""

    code: str
    """The daemon's or the client's error code, e.g. "NOT_FOUND", "BAD_SOURCE", "CONNECT"."""
    message: str
    """The reason."""

class View:
    """A read-only byte range of a mapping (buffer protocol); keeps the mapping alive."""

class Segment:
    @property
    def key(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def address(self) -> int: ...
    def entries(self) -> list[dict]: ...
    def publisher(self) -> Optional[dict]: ...
    def view(self, offset: int, length: int) -> View: ...
    def verify(self) -> None: ...

class Client:
    def __init__(self, socket_dir: Optional[Union[str, os.PathLike]] = None, *,
                 timeout: Optional[float] = None, pack_timeout: Optional[float] = None,
                 connect_timeout: Optional[float] = None) -> None: ...
    def pack(self, source: Union[str, os.PathLike, int], layout: Optional[str] = None,
             rules: list[str] = ...) -> Segment: ...
    def get(self, key: str) -> Segment: ...

def xnnpack_enable() -> str: ...
def xnnpack_status() -> str: ...
