#!/usr/bin/env python3
"""One builder alone: the engine's default against packd (and, with --b-env, packd with other
variables: B), alternated round by round, each packd run with a fresh daemon and an empty
names memo, so the worker builds.

    python examples/builder.py executorch MODEL.pte [--python PY]
    python examples/builder.py llama MODEL.gguf [--llama-root ROOT] [--lib LIB]
        [--rounds 20] [--load quiet|busy] [--packd-bin target/release/packd]
        [--b-env NAME=VALUE ...]

Prints, for each, the medians of the load and of what a worker's first request waits for
(first), and their ratios to the default's:
  executorch  examples/executorch/worker.py: load_method; first = load + the first execute.
  llama       examples/llama/holder.c (built against ROOT, as examples/llama/bench.py does;
              packd through LD_PRELOAD=LIB): llama_model_load_from_file; first = load, the
              context and a first prompt of 16 tokens.
busy: two CPU-bound processes at nice 0 run meanwhile. Outputs must be identical in every run
(checked). B runs an older packd with, for ExecuTorch, PYTHONPATH=DIR (an older package:
`pip install --target DIR ./python`) or, for llama.cpp, LD_PRELOAD=OLD/libpackd_llama.so.
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
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "llama"))
from bench import daemon as start_daemon, holder_bin as llama_holder  # noqa: E402


def executorch(a, packd: bool, env: dict, tmp: str) -> dict:
    args = [a.python, str(HERE / "executorch" / "worker.py"), a.model] + (["--packd"] if packd else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    line = json.loads(out.strip().splitlines()[-1])
    return {"load": line["load_ms"], "first": line["load_ms"] + line["run_ms"], "output": line["output_sha256"],
            "built": line["packd"].get("built") if packd else None}


def llama(a, packd: bool, env: dict, tmp: str) -> dict:
    status = os.path.join(tmp, "status.json")
    if packd:
        env = {"LD_PRELOAD": a.lib, "PACKD_LLAMA_STATUS": status, **env}
    args = [a.holder, a.model, "--prompt", "16", "--gen", "0"]
    # Run in the root's libraries, where ggml's loader finds the CPU variants of a release
    # layout (as examples/llama/bench.py does).
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(a.llama_root) / "lib").stdout
    line = json.loads(out.strip().splitlines()[-1])
    built = None
    if packd:
        built = json.loads(open(status).read().strip().splitlines()[-1]).get("built")
    return {"load": line["load_ms"], "first": line["first_ms"], "output": line["logits"], "built": built}


def run(a, kind: str, extra: dict) -> dict:
    env = dict(os.environ)
    d = None
    tmp = tempfile.mkdtemp(prefix="packd-builder-")
    packd = kind != "default"
    if packd:
        d, sock = start_daemon(a.packd_bin, tmp)
        env.update(PACKD_SOCKET_DIR=sock, PACKD_NAMES=os.path.join(tmp, "names"))
    try:
        got = {"executorch": executorch, "llama": llama}[a.engine](a, packd, {**env, **extra}, tmp)
    finally:
        if d:
            d.terminate()
            d.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    if packd and got["built"] != 1:
        raise SystemExit(f"{kind}: the worker did not build (built: {got['built']})")
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", choices=["executorch", "llama"])
    p.add_argument("model")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--llama-root", default=str(ROOT / ".ci" / "cache" / "llama" / "0.3.36" / "root"))
    p.add_argument("--lib", default=str(ROOT / "target" / "release" / "libpackd_llama.so"))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--load", choices=["quiet", "busy"], default="quiet")
    p.add_argument("--packd-bin", default=str(ROOT / "target" / "release" / "packd"))
    p.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE")
    a = p.parse_args()
    if a.engine == "llama":
        a.holder = llama_holder(pathlib.Path(a.llama_root))
    with open(a.model, "rb") as f:  # into the page cache
        while f.read(1 << 24):
            pass
    kinds = {"default": {}, "packd": {}}
    if a.b_env:
        kinds["B"] = dict(kv.split("=", 1) for kv in a.b_env)
    busy = []
    if a.load == "busy":
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    got = {k: [] for k in kinds}
    try:
        for r in range(a.rounds):
            order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
            for k in order:
                got[k].append(run(a, k, kinds[k]))
    finally:
        for b in busy:
            b.kill()
    outputs = {x["output"] for runs in got.values() for x in runs}
    if len(outputs) != 1:
        raise SystemExit(f"outputs differ: {outputs}")
    base = {m: statistics.median(x[m] for x in got["default"]) for m in ("load", "first")}
    print(f"{a.engine}, {a.load}, {a.rounds} rounds, outputs identical")
    for k, runs in got.items():
        med = {m: statistics.median(x[m] for x in runs) for m in ("load", "first")}
        print(f"{k:8s} load {med['load']:7.1f} ms ({med['load'] / base['load']:.2f} x)   "
              f"first {med['first']:7.1f} ms ({med['first'] / base['first']:.2f} x)")


if __name__ == "__main__":
    main()
