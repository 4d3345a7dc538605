#!/usr/bin/env python3
"""A FUSE file system whose files stop answering: the stand-in for a hung NFS or FUSE mount
in packd's hostile-client tests.

    hung_fs.py MOUNTPOINT SOURCE ANSWER_BYTES [RELEASE_FILE [flush]]

MOUNTPOINT shows one regular file, `model.safetensors`, with SOURCE's size and bytes. Reads
are answered until they have served ANSWER_BYTES bytes in all; the read that would go past
that does not return until RELEASE_FILE exists (then it, and every read after it, is
answered), or never without RELEASE_FILE (until the file system is unmounted or this
process dies). With `flush`, every flush (the kernel sends one at each close(2) of an fd of
the file, and waits for the answer) also waits for RELEASE_FILE. Runs in the foreground; needs root and /dev/fuse, and the fusepy package
(libfuse2).
"""
import errno
import os
import stat
import sys
import threading
import time

from fuse import FUSE, FuseOSError, Operations

NAME = "/model.safetensors"


class Hung(Operations):
    def __init__(self, data, answer, release, hang_flush=False):
        self.data = data
        self.answer = answer
        self.hang_flush = hang_flush
        self.served = 0
        self.mutex = threading.Lock()
        self.released = threading.Event()
        if release:
            threading.Thread(target=self.watch, args=(release,), daemon=True).start()

    def watch(self, release):
        """Answers the hung reads once `release` exists."""
        while not os.path.exists(release):
            time.sleep(0.01)
        self.released.set()

    def getattr(self, path, fh=None):
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        if path == NAME:
            return {"st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": len(self.data),
                    "st_mtime": 1, "st_ctime": 1}
        raise FuseOSError(errno.ENOENT)

    def readdir(self, path, fh):
        return [".", "..", NAME[1:]]

    def open(self, path, flags):
        if path != NAME:
            raise FuseOSError(errno.ENOENT)
        return 0

    def flush(self, path, fh):
        if self.hang_flush:
            self.released.wait()  # the close that called it returns only once released
        return 0

    def read(self, path, size, offset, fh):
        chunk = self.data[offset:offset + size]
        with self.mutex:
            hang = self.served + len(chunk) > self.answer and not self.released.is_set()
            if not hang:
                self.served += len(chunk)
        if hang:
            self.released.wait()  # the hang: answered only once released
        return chunk


def main():
    mountpoint, source, answer = sys.argv[1], sys.argv[2], int(sys.argv[3])
    release = sys.argv[4] if len(sys.argv) > 4 else None
    hang_flush = len(sys.argv) > 5 and sys.argv[5] == "flush"
    with open(source, "rb") as f:
        data = f.read()
    # direct_io: every read reaches us (no page cache serves it); nothreads=False so a
    # hung read does not stop other requests (getattr, release).
    FUSE(Hung(data, answer, release, hang_flush), mountpoint, foreground=True, nothreads=False, direct_io=True,
         allow_other=True, ro=True)


if __name__ == "__main__":
    main()
