#!/usr/bin/env python3
"""What a build's memory costs in small and in huge shared pages, alternated in one run.

Each round allocates SIZE MiB four ways and writes every byte, as a builder does:
private anonymous memory (what an engine uses without packd), a memfd with small pages
(`shmem`), a memfd allocated with `fallocate` (`fallocate`), and a memfd allocated through
a mapping advised MADV_HUGEPAGE (`advised`: what packd's builders do where
/sys/kernel/mm/transparent_hugepage/shmem_enabled is `advise`). Prints each and the
medians. Changes no setting: run it once under each `shmem_enabled` to compare.

    python3 examples/huge-pages.py [--size 476] [--rounds 6]
"""

import argparse
import ctypes
import os
import statistics
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
PROT_RW, MAP_SHARED, MAP_PRIVATE_ANON = 3, 0x01, 0x22
MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23


def once(mode, n):
    t = time.perf_counter()
    fd = None
    if mode == "anon":
        a = libc.mmap(None, n, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
    else:
        fd = os.memfd_create("huge-pages-bench")
        os.ftruncate(fd, n)
        if mode == "fallocate":
            os.posix_fallocate(fd, 0, n)
        a = libc.mmap(None, n, PROT_RW, MAP_SHARED, fd, 0)
        if mode == "advised":
            libc.madvise(a, n, MADV_HUGEPAGE)
    if libc.madvise(a, n, MADV_POPULATE_WRITE) != 0:
        raise SystemExit("MADV_POPULATE_WRITE failed (Linux 5.14+ needed)")
    libc.memset(a, 1, n)
    took = 1000 * (time.perf_counter() - t)
    libc.munmap(a, n)
    if fd is not None:
        os.close(fd)
    return took


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=476, help="MiB per build (default 476)")
    ap.add_argument("--rounds", type=int, default=6, help="alternated rounds (default 6)")
    args = ap.parse_args()
    setting = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read().strip()
    defrag = open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip()
    print(f"shmem_enabled: {setting}\ndefrag: {defrag}")
    modes = ["anon", "shmem", "fallocate", "advised"]
    times = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            times[m].append(once(m, args.size << 20))
        print(f"round {r + 1}: " + "  ".join(f"{m} {times[m][-1]:.1f} ms" for m in modes))
    base = statistics.median(times["shmem"])
    for m in modes:
        med = statistics.median(times[m])
        print(f"{m:10s} median {med:7.1f} ms  ({med / base:.2f} x small shared pages)")


if __name__ == "__main__":
    main()
