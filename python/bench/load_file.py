#!/usr/bin/env python3
"""Time to weights in Python: `packd.load_file` (the model already packed) against
`safetensors.numpy.load_file` on the same file, in the same run, alternating.

    python3 python/bench/load_file.py MODEL.safetensors [--socket-dir DIR] [--runs 20]

Needs a running packd, the packd package and `safetensors` (pip). Reports the median and
the best of each, their ratio, and checks that both give the same arrays. Also reports the
bytes each copies: safetensors reads every weight into private memory; packd maps.
"""

import argparse
import statistics
import time

import numpy as np
import packd
from safetensors.numpy import load_file as st_load_file


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--socket-dir", default=None)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()

    # Pack once (not timed): the case of every worker after the first.
    first = packd.load_file(args.model, socket_dir=args.socket_dir)
    reference = st_load_file(args.model)
    assert list(first) == list(reference) or set(first) == set(reference)
    for name, arr in reference.items():
        np.testing.assert_array_equal(first[name], arr)
    total = sum(a.nbytes for a in reference.values())
    del first, reference

    t_packd, t_st = [], []
    for _ in range(args.runs):
        t = time.perf_counter()
        w = packd.load_file(args.model, socket_dir=args.socket_dir)
        t_packd.append(time.perf_counter() - t)
        del w
        t = time.perf_counter()
        w = st_load_file(args.model)
        t_st.append(time.perf_counter() - t)
        del w
    mp, ms = statistics.median(t_packd), statistics.median(t_st)
    print(f"model {args.model}: {total / 2**20:.1f} MiB of weights, {args.runs} runs each, alternating")
    print(f"safetensors.numpy.load_file: median {ms * 1e3:.2f} ms, best {min(t_st) * 1e3:.2f} ms "
          f"(copies {total / 2**20:.1f} MiB into private memory)")
    print(f"packd.load_file:             median {mp * 1e3:.2f} ms, best {min(t_packd) * 1e3:.2f} ms "
          f"(copies 0 bytes: views of the shared mapping)")
    print(f"speed-up: {ms / mp:.1f} x (median), {min(t_st) / min(t_packd):.1f} x (best)")


if __name__ == "__main__":
    main()
