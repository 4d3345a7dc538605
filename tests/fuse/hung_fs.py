#!/usr/bin/env python3
"""A FUSE file system whose files stop answering: the stand-in for a hung NFS or FUSE mount
in packd's hostile-client tests.

    hung_fs.py MOUNTPOINT SOURCE ANSWER_BYTES

MOUNTPOINT shows one regular file, `model.safetensors`, with SOURCE's size and bytes. Reads
are answered until they have served ANSWER_BYTES bytes in all; the read that would go past
that never returns (until the file system is unmounted or this process dies). Runs in the foreground; needs root and /dev/fuse, and
the fusepy package (libfuse2).
"""
import errno
import os
import stat
import sys
import threading

from fuse import FUSE, FuseOSError, Operations

NAME = "/model.safetensors"


class Hung(Operations):
    def __init__(self, data, answer):
        self.data = data
        self.answer = answer
        self.served = 0
        self.mutex = threading.Lock()
        self.never = threading.Event()

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

    def read(self, path, size, offset, fh):
        chunk = self.data[offset:offset + size]
        with self.mutex:
            hang = self.served + len(chunk) > self.answer
            if not hang:
                self.served += len(chunk)
        if hang:
            self.never.wait()  # the hang: never answered
        return chunk


def main():
    mountpoint, source, answer = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(source, "rb") as f:
        data = f.read()
    # direct_io: every read reaches us (no page cache serves it); nothreads=False so a
    # hung read does not stop other requests (getattr, release).
    FUSE(Hung(data, answer), mountpoint, foreground=True, nothreads=False, direct_io=True,
         allow_other=True, ro=True)


if __name__ == "__main__":
    main()
