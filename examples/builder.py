#!/usr/bin/env python3
"""One ExecuTorch builder alone: ExecuTorch's default against packd (and, with --b-env, packd
with other variables: B), alternated round by round, each packd run with a fresh daemon and
an empty names memo, so the worker builds.

    python examples/executorch/builder.py MODEL.pte [--python PY] [--rounds 20]
        [--load quiet|busy] [--packd-bin target/release/packd] [--b-env NAME=VALUE ...]

Prints, for each, the medians of load_method (load) and of load plus the first execute
(load + run: what a worker's first request waits for), and their ratios to the default's.
busy: two CPU-bound processes at nice 0 run meanwhile. Outputs must be identical in every
run (checked). B with PYTHONPATH=DIR runs an older packd package installed there
(`pip install --target DIR ./python`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent / "llama"))
from bench import daemon as start_daemon  # noqa: E402


def run(a, kind: str, extra: dict) -> dict:
    args = [a.python, str(HERE / "worker.py"), a.model]
    env = dict(os.environ)
    d = None
    tmp = tempfile.mkdtemp(prefix="packd-builder-")
    if kind != "default":
        d, sock = start_daemon(a.packd_bin, tmp)
        env.update(PACKD_SOCKET_DIR=sock, PACKD_NAMES=os.path.join(tmp, "names"), **extra)
        args.append("--packd")
    try:
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    finally:
        if d:
            d.terminate()
            d.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    line = json.loads(out.strip().splitlines()[-1])
    if kind != "default" and line["packd"]["built"] != 1:
        raise SystemExit(f"{kind}: the worker did not build: {line['packd']}")
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--load", choices=["quiet", "busy"], default="quiet")
    p.add_argument("--packd-bin", default=str(ROOT / "target" / "release" / "packd"))
    p.add_argument("--b-env", action="append", default=[])
    a = p.parse_args()
    kinds = {"default": {}, "packd": {}}
    if a.b_env:
        kinds["B"] = dict(kv.split("=", 1) for kv in a.b_env)
    busy = []
    if a.load == "busy":
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    lines = {k: [] for k in kinds}
    try:
        for r in range(a.rounds):
            order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
            for k in order:
                lines[k].append(run(a, k, kinds[k]))
    finally:
        for b in busy:
            b.kill()
    outputs = {line["output_sha256"] for ls in lines.values() for line in ls}
    if len(outputs) != 1:
        raise SystemExit(f"outputs differ: {outputs}")
    base = statistics.median(x["load_ms"] for x in lines["default"])
    base_run = statistics.median(x["load_ms"] + x["run_ms"] for x in lines["default"])
    print(f"{a.load}, {a.rounds} rounds, outputs identical")
    for k, ls in lines.items():
        load = statistics.median(x["load_ms"] for x in ls)
        both = statistics.median(x["load_ms"] + x["run_ms"] for x in ls)
        fin = statistics.median(x.get("packd", {}).get("finalize_us", 0) for x in ls) / 1e3
        print(f"{k:8s} load {load:6.1f} ms ({load / base:.2f} x)   load + run {both:6.1f} ms "
              f"({both / base_run:.2f} x)   finalize {fin:.2f} ms")


if __name__ == "__main__":
    main()
