#!/usr/bin/env python3
"""Cold start: N workers started at once on a model nobody packed, as the engine runs them
by default and through packd, on a quiet host and beside two CPU-bound processes at nice 0.

    python examples/coldstart.py llama MODEL.gguf [--llama-root ROOT]
    python examples/coldstart.py executorch MODEL.pte [--python PY]
    python examples/coldstart.py litert MODEL.tflite [--python PY]
        [--workers 1,4,8] [--rounds 3] [--load quiet,busy] [--packd-bin target/release/packd]
        [--lib target/release/libpackd_llama.so] [--b-env NAME=VALUE ...] [--json]

Engines:
  llama       examples/llama/holder.c (built here against ROOT, as examples/llama/bench.py
              does) loading the GGUF; packd through LD_PRELOAD=libpackd_llama.so. Time to
              ready: the worker's llama_model_load_from_file (packd's digest, acquire,
              wait, repack and sealing included).
  executorch  examples/executorch/worker.py under PY (a Python with ExecuTorch and the packd
              package); packd through packd.executorch.enable(). Time to ready: the
              worker's load_method.
  litert      examples/litert/worker.py under PY (a Python with ai-edge-litert and the
              packd package); packd through packd.litert.enable(). Time to ready: the
              worker's compile and first inference (LiteRT packs its weights at the first
              one); the default is LiteRT without a weight cache file, each worker packing.

Workers of the Python engines import first, say so and wait; when all N have, they are given
one start time (examples/together.py), so N loads start at one instant and never beside
another worker's imports.

Every round runs, for each load and N, the default and packd one after the other (the order
alternates between rounds); each packd run gets a fresh daemon (no cache directory) and an
empty names memo, so worker 1 builds and the model is hashed. While all N hold the model:
Σ Pss of the workers, plus the whole daemon's Pss for packd. Ratios are against the
default's median worker at the same N and load in the same round, then the median over
rounds is printed (with the range). The model file is read once before the rounds, so its
pages are in the page cache for every run.

With --b-env NAME=VALUE (repeatable), every round also runs packd with those variables set
in the workers (B: e.g. PACKD_PROVISIONAL_NAMES=off, the digest before the build), in turn
with the others, and prints its row beside packd's: an A/B of two ways in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent


# The helpers of the llama.cpp bench: a daemon of its own, a process's Pss, the holder.
sys.path.insert(0, str(HERE / "llama"))
from bench import daemon as start_daemon, holder_bin as llama_holder, pss  # noqa: E402

sys.path.insert(0, str(HERE))
import together  # noqa: E402


class Llama:
    """llama.cpp workers (holder.c) holding the GGUF until their stdin closes."""

    def __init__(self, a):
        self.model = a.model
        self.holder = llama_holder(pathlib.Path(a.llama_root))
        self.lib = a.lib

    def spawn(self, n: int, sock, tmp: str, extra: dict):
        env = dict(os.environ)
        if sock:
            env.update(LD_PRELOAD=self.lib, PACKD_SOCKET_DIR=sock, PACKD_NAMES=os.path.join(tmp, "names"))
            env.update(extra)  # B may name another library (LD_PRELOAD=...)
        procs = []
        for i in range(n):
            if sock:
                env["PACKD_LLAMA_STATUS"] = os.path.join(tmp, f"status-{i}.json")
            procs.append(subprocess.Popen([self.holder, self.model, "--hold", "--prompt", "16", "--gen", "0"],
                                          env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True))
        return procs

    def ready(self, p) -> dict:
        line = json.loads(p.stdout.readline())
        p.stdout.readline()  # "ready"
        return {"ms": line["load_ms"], "digest": line["logits"]}

    def stop(self, procs, sock, tmp: str):
        for p in procs:
            p.stdin.close()
            p.wait()
        built = []
        for i in range(len(procs)):
            try:
                s = json.loads(open(os.path.join(tmp, f"status-{i}.json")).read().strip().splitlines()[-1])
                built.append(s.get("built", 0) > 0)
            except (OSError, ValueError, IndexError):
                built.append(False)
        return built if sock else [False] * len(procs)


class ExecuTorch:
    """ExecuTorch workers (worker.py), started at one moment, holding the model."""

    def __init__(self, a):
        self.model = a.model
        self.python = a.python

    def spawn(self, n: int, sock, tmp: str, extra: dict):
        env = dict(os.environ)
        cmd = [self.python, str(HERE / "executorch" / "worker.py"), self.model, "--hold", "600"]
        if sock:
            env.update(PACKD_SOCKET_DIR=sock, PACKD_NAMES=os.path.join(tmp, "names"), **extra)
            cmd.append("--packd")
        procs = [subprocess.Popen(cmd + ["--start-at", "stdin"], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(n)]
        together.start(procs)
        return procs

    def ready(self, p) -> dict:
        line = json.loads(p.stdout.readline())
        status = line.get("packd", {})
        phases = {k[:-3]: status[k] / 1e3 for k in PHASES if k in status}
        return {"ms": line["load_ms"], "digest": line["output_sha256"], "built": bool(status.get("built", 0)),
                "phases": dict(phases, cpu=line["load_cpu_ms"]) if status else None}

    def stop(self, procs, sock, tmp: str):
        for p in procs:
            p.kill()
            p.wait()
        return None


class LiteRT:
    """LiteRT workers (worker.py), started at one moment, holding the compiled model."""

    def __init__(self, a):
        self.model = a.model
        self.python = a.python

    def spawn(self, n: int, sock, tmp: str, extra: dict):
        env = dict(os.environ)
        cmd = [self.python, str(HERE / "litert" / "worker.py"), self.model, "--hold"]
        if sock:
            env.update(PACKD_SOCKET_DIR=sock, PACKD_NAMES=os.path.join(tmp, "names"), **extra)
            cmd.append("--packd")
        procs = [subprocess.Popen(cmd + ["--start-at", "stdin"], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for _ in range(n)]
        together.start(procs)
        return procs

    def ready(self, p) -> dict:
        line = json.loads(p.stdout.readline())
        built = bool((line.get("packd") or {}).get("built", 0))
        return {"ms": line["ready_s"] * 1e3, "digest": line["output_sha256"], "built": built}

    def stop(self, procs, sock, tmp: str):
        for p in procs:
            p.stdin.close()
            p.wait()
        return None


# Where a packd worker's time goes, from its status() (ExecuTorch): milliseconds.
PHASES = ["hash_us", "acquire_us", "create_us", "hash_beside_us", "finalize_us"]


def one_run(engine, n: int, packd_bin, with_packd: bool, extra: dict):
    with tempfile.TemporaryDirectory() as tmp:
        proc, sock = start_daemon(packd_bin, tmp) if with_packd else (None, None)
        try:
            procs = engine.spawn(n, sock, tmp, extra)
            lines = [engine.ready(p) for p in procs]
            time.sleep(0.3)
            total = sum(pss(p.pid) for p in procs) + (pss(proc.pid) if proc else 0)
            built = engine.stop(procs, sock, tmp)
            if built is None:
                built = [x.get("built", False) for x in lines]
            stats = None
            if proc:
                out = subprocess.run([str(ROOT / "target" / "release" / "packctl"), "--socket-dir", sock, "stats",
                                      "--json"], capture_output=True, text=True)
                stats = json.loads(out.stdout) if out.returncode == 0 else None
        finally:
            if proc:
                proc.kill()
                proc.wait()
    return {"ms": [x["ms"] for x in lines], "phases": [x.get("phases") for x in lines], "digests": {x["digest"] for x in lines}, "built": built, "pss": total,
            "hashes": stats and stats.get("source_hashes"), "slow": stats and stats.get("build_waits_slow")}


def hogs(n: int):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=["llama", "executorch", "litert"])
    ap.add_argument("model")
    ap.add_argument("--workers", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", default="quiet,busy")
    ap.add_argument("--packd-bin", default=str(ROOT / "target" / "release" / "packd"))
    ap.add_argument("--lib", default=str(ROOT / "target" / "release" / "libpackd_llama.so"))
    ap.add_argument("--llama-root", default=str(ROOT / ".ci" / "cache" / "llama" / "0.3.36" / "root"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                    help="also run packd with these in the workers' environment (B), in turn")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    b_env = dict(kv.split("=", 1) for kv in a.b_env)
    engine = {"llama": Llama, "executorch": ExecuTorch, "litert": LiteRT}[a.engine](a)
    with open(a.model, "rb") as f:  # into the page cache
        while f.read(1 << 24):
            pass
    rows = []
    for load in a.load.split(","):
        busy = hogs(2) if load == "busy" else []
        try:
            for n in [int(x) for x in a.workers.split(",")]:
                rounds = []
                configs = [False, True] + (["b"] if b_env else [])
                for r in range(a.rounds):
                    order = configs[r % len(configs):] + configs[:r % len(configs)]
                    got = {cfg: one_run(engine, n, a.packd_bin, bool(cfg), b_env if cfg == "b" else {})
                           for cfg in order}
                    rounds.append(got)
                rows.append(summarize(a.engine, load, n, rounds))
                print(json.dumps(rows[-1]) if a.json else line(rows[-1]), flush=True)
                if b_env:
                    label = f"{a.engine} (B: {' '.join(a.b_env)})"
                    b_rounds = [{False: got[False], True: got["b"]} for got in rounds]
                    rows.append(summarize(label, load, n, b_rounds))
                    print(json.dumps(rows[-1]) if a.json else line(rows[-1]), flush=True)
        finally:
            for h in busy:
                h.kill()
                h.wait()


def summarize(engine: str, load: str, n: int, rounds) -> dict:
    per = []
    for got in rounds:
        d, p = got[False], got[True]
        base = statistics.median(d["ms"])
        builders = [ms for ms, b in zip(p["ms"], p["built"]) if b]
        phases = [ph for ph, b in zip(p["phases"], p["built"]) if b and ph]
        waits = [ph["acquire"] for ph, b in zip(p["phases"], p["built"]) if not b and ph and "acquire" in ph]
        others = [ms for ms, b in zip(p["ms"], p["built"]) if not b]
        per.append({
            "default_ms": base,
            "builder_ms": builders[0] if builders else None,
            "others_ms": statistics.median(others) if others else None,
            "slowest_x": max(p["ms"]) / base,
            "others_x": statistics.median(others) / base if others else None,
            "builder_x": builders[0] / base if builders else None,
            "pss_default": d["pss"],
            "pss_packd": p["pss"],
            "pss_x": p["pss"] / d["pss"],
            "built": sum(p["built"]),
            "same_output": d["digests"] == p["digests"] and len(d["digests"]) == 1,
            "hashes": p["hashes"],
            "slow": p["slow"],
            "builder_phases": phases[0] if phases else None,
            "others_wait_ms": statistics.median(waits) if waits else None,
        })
    med = lambda k: statistics.median([x[k] for x in per if x[k] is not None]) if any(  # noqa: E731
        x[k] is not None for x in per) else None
    rng = lambda k: [min(x[k] for x in per if x[k] is not None), max(x[k] for x in per if x[k] is not None)] if any(  # noqa: E731
        x[k] is not None for x in per) else None
    return {"engine": engine, "load": load, "workers": n, "rounds": len(per),
            **{k: med(k) for k in ["default_ms", "builder_ms", "others_ms", "slowest_x", "builder_x", "others_x",
                                    "pss_default", "pss_packd", "pss_x"]},
            "slowest_x_range": rng("slowest_x"), "others_x_range": rng("others_x"),
            "built": [x["built"] for x in per], "hashes": [x["hashes"] for x in per],
            "slow_waits": [x["slow"] for x in per], "same_output": all(x["same_output"] for x in per),
            "builder_phases_ms": phases_median([x["builder_phases"] for x in per if x["builder_phases"]]),
            "others_wait_ms": med("others_wait_ms")}


def phases_median(rounds: list) -> dict | None:
    """Each phase's median over the rounds (the builder's own, per round)."""
    if not rounds:
        return None
    return {k: round(statistics.median(r[k] for r in rounds if k in r), 1) for k in rounds[0]}


def line(r: dict) -> str:
    f = lambda v, spec=".2f": "—" if v is None else format(v, spec)  # noqa: E731
    return (f"| {r['engine']} | {r['load']} | {r['workers']} | {f(r['default_ms'], '.0f')} | {f(r['builder_ms'], '.0f')}"
            f" ({f(r['builder_x'])}×) | {f(r['others_ms'], '.0f')} ({f(r['others_x'])}×) | {f(r['slowest_x'])}×"
            f" {r['slowest_x_range']} | {r['pss_default'] / 2**20:.0f} → {r['pss_packd'] / 2**20:.0f} MiB"
            f" ({f(r['pss_x'])}×) | built {r['built']}, hashes {r['hashes']}, slow {r['slow_waits']}"
            f" | {'yes' if r['same_output'] else 'NO'} |"
            + (f" builder ms {r['builder_phases_ms']}, others waited {f(r['others_wait_ms'], '.1f')} ms"
               if r.get("builder_phases_ms") else ""))


if __name__ == "__main__":
    main()
