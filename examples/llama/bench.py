#!/usr/bin/env python3
"""llama.cpp workers side by side: N processes holding one GGUF, as llama.cpp runs them by
default (each repacks into private memory), with --no-repack (no repacked copy, slower
kernels), and through packd (LD_PRELOAD=libpackd_llama.so: the first repacks and publishes,
the others map the host's copy), with (packd+drop, the default now) and without
(PACKD_LLAMA_DROP_SOURCE=0) the source pages dropped.

    python bench.py MODEL.gguf [--workers 1,4,8] [--runs 1] [--prompt 64] [--gen 32]
                    [--ab 8] [--llama-root ROOT] [--packd-bin target/release/packd]
                    [--lib target/release/libpackd_llama.so] [--json]

Per configuration and N (each packd row on a fresh daemon with no cache directory, so that
worker 1 builds; the model file's pages warm in the page cache):
  load1_ms      llama_model_load_from_file of worker 1 (packd: the builder)
  load_rest_ms  median load of workers 2..N, each started once the one before holds
  prompt_tps    prompt tokens/s of the last worker (served, for packd), the others idle
  gen_tps       generation tokens/s of the same worker
  pss_mib       Σ Pss of the N workers (and of packd, for packd rows) while all hold
  logits        whether every worker's logits digest equals the default's worker 1
Ratios are against the default configuration of the same N in the same run. Then, since
load times and tokens/s of one process swing by ±15 % on a busy 2-core machine, an A/B:
--ab rounds, each running alone, back to back, a default worker, a packd builder (fresh
daemon, empty names memo, so the GGUF is hashed) and a worker it serves; the ratios
packd/default are taken per round, and their medians and ranges printed. Prints a
Markdown table and, with --json, one JSON line per row. The holder (holder.c) is built here
against ROOT (examples/llama/fetch-llama prints it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def holder_bin(root: pathlib.Path) -> str:
    """holder.c built against ROOT (one binary per root)."""
    tag = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    out = ROOT / "target" / "llama-example" / f"holder-{tag}"
    src = HERE / "holder.c"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        # llama.cpp before load_mode (llama-cpp-python < 0.3.36) says use_mmap.
        old = "enum llama_load_mode" not in (root / "include" / "llama.h").read_text()
        subprocess.run(["cc", "-O2", *(["-DHOLDER_USE_MMAP_BOOL"] if old else []), str(src),
                        f"-I{root / 'include'}", f"-L{root / 'lib'}", "-lllama", "-lggml", "-lggml-base",
                        f"-Wl,--disable-new-dtags,-rpath,{root / 'lib'}", "-o", str(out)], check=True)
    return str(out)


def libs(args) -> str:
    """The root's libraries: the workers run there, where ggml's loader finds the CPU
    variants of a release-layout root (fetch-llama --layout release)."""
    return str(pathlib.Path(args.llama_root) / "lib")


def daemon(binary: str, tmp: str):
    sock = os.path.join(tmp, "sock")
    os.makedirs(sock, exist_ok=True)
    log = open(os.path.join(tmp, "packd.log"), "w")
    proc = subprocess.Popen([binary, "--socket-dir", sock, "--cache-dir", "off", "--fd-store", "off"], stderr=log)
    deadline = time.time() + 20
    while not os.path.exists(os.path.join(sock, "packd.sock")):
        if time.time() > deadline or proc.poll() is not None:
            raise SystemExit(f"packd did not start; see {tmp}/packd.log")
        time.sleep(0.02)
    return proc, sock


def run(args, holder: str, config: str, n: int):
    env = dict(os.environ)
    extra = []
    d = None
    tmp = tempfile.mkdtemp(prefix="packd-llama-bench-")
    if config == "no-repack":
        extra = ["--no-repack"]
    if config.startswith("packd"):
        d, sock = daemon(args.packd_bin, tmp)
        env.update(LD_PRELOAD=args.lib, PACKD_SOCKET_DIR=sock, PACKD_NAMES=os.path.join(tmp, "names"))
        # Source pages are dropped by default now; "packd" keeps them, as before.
        env["PACKD_LLAMA_DROP_SOURCE"] = "1" if config == "packd+drop" else "0"
    procs, lines = [], []
    try:
        for i in range(n):
            p = subprocess.Popen([holder, args.model, "--hold", "--prompt", str(args.prompt), "--gen",
                                  str(args.gen), "--threads", str(args.threads)] + extra,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env, cwd=libs(args))
            procs.append(p)
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"{config} worker {i + 1} failed: {p.stderr.read()}")
            lines.append(json.loads(line))
            assert p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        total = sum(pss(p.pid) for p in procs) + (pss(d.pid) if d else 0)
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait()
        if d:
            d.terminate()
            d.wait()
    loads = [x["load_ms"] for x in lines]
    return {
        "config": config, "n": n, "load1_ms": loads[0],
        "load_rest_ms": statistics.median(loads[1:]) if n > 1 else None,
        "prompt_tps": lines[-1]["prompt_tps"], "gen_tps": lines[-1]["gen_tps"],
        "pss_mib": total / 2**20, "digests": sorted({x["logits"] for x in lines}),
    }


def ab(args, holder: str):
    """Rounds of: a default worker; a packd builder (a fresh daemon, an empty names memo: the
    model is hashed); a packd worker served by it — one at a time; ratios per round."""
    cmd = [holder, args.model, "--prompt", str(args.prompt), "--gen", str(args.gen), "--threads", str(args.threads)]
    one = lambda env=None: json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True,
                                                     cwd=libs(args)).stdout.splitlines()[0])
    ratios = {"builder load": [], "served load": [], "served prompt_tps": [], "served gen_tps": []}
    for _ in range(args.ab):
        tmp = tempfile.mkdtemp(prefix="packd-llama-ab-")
        d, sock = daemon(args.packd_bin, tmp)
        packd = dict(os.environ, LD_PRELOAD=args.lib, PACKD_SOCKET_DIR=sock,
                     PACKD_NAMES=os.path.join(tmp, "names"))
        try:
            a = one()
            b = one(packd)  # exits once its publication is answered
            c = one(packd)
        finally:
            d.terminate()
            d.wait()
        if not a["logits"] == b["logits"] == c["logits"]:
            raise SystemExit(f"logits differ: {a} {b} {c}")
        ratios["builder load"].append(b["load_ms"] / a["load_ms"])
        ratios["served load"].append(c["load_ms"] / a["load_ms"])
        ratios["served prompt_tps"].append(c["prompt_tps"] / a["prompt_tps"])
        ratios["served gen_tps"].append(c["gen_tps"] / a["gen_tps"])
    print(f"A/B over {args.ab} rounds, one worker at a time, packd / default per round:")
    for k, v in ratios.items():
        print(f"  {k}: median {statistics.median(v):.3f} (range {min(v):.3f}–{max(v):.3f})")
        if args.json:
            print(json.dumps({"ab": k, "median": statistics.median(v), "ratios": v}), file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--workers", default="1,4,8")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--llama-root", default=os.environ.get("LLAMA_ROOT", str(ROOT / ".ci/cache/llama/0.3.36/root")))
    ap.add_argument("--packd-bin", default=str(ROOT / "target/release/packd"))
    ap.add_argument("--lib", default=str(ROOT / "target/release/libpackd_llama.so"))
    ap.add_argument("--ab", type=int, default=8, help="rounds of the speed A/B (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for f in (args.packd_bin, args.lib, args.model):
        if not os.path.exists(f):
            sys.exit(f"bench.py: {f} is missing (cargo build --release -p packd -p packd-llama; make-model.py)")
    args.model, args.packd_bin, args.lib, args.llama_root = (
        os.path.abspath(f) for f in (args.model, args.packd_bin, args.lib, args.llama_root))
    holder = holder_bin(pathlib.Path(args.llama_root))
    subprocess.run(["cat", args.model], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    rows = []
    for n in [int(x) for x in args.workers.split(",")]:
        for config in ("default", "no-repack", "packd", "packd+drop"):
            runs = [run(args, holder, config, n) for _ in range(args.runs)]
            row = dict(runs[0])
            for k in ("load1_ms", "load_rest_ms", "prompt_tps", "gen_tps", "pss_mib"):
                vals = [r[k] for r in runs if r[k] is not None]
                row[k] = statistics.median(vals) if vals else None
            rows.append(row)
    ref = {r["n"]: r for r in rows if r["config"] == "default"}
    want = ref[min(ref)]["digests"][0]
    print("| N | config | Σ Pss MiB | × default | load 1 ms | × | load 2..N ms | × | prompt t/s | × | gen t/s | × | logits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = ref[r["n"]]
        ratio = lambda k: (f"{r[k] / b[k]:.2f}" if r[k] is not None and b[k] else "–")
        fmt = lambda v, p=0: "–" if v is None else f"{v:.{p}f}"
        same = "same" if r["digests"] == [want] else ("differ (other kernels)" if r["config"] == "no-repack" else "DIFFER")
        print(f"| {r['n']} | {r['config']} | {fmt(r['pss_mib'])} | {ratio('pss_mib')} | {fmt(r['load1_ms'])} | "
              f"{ratio('load1_ms')} | {fmt(r['load_rest_ms'])} | {ratio('load_rest_ms')} | {fmt(r['prompt_tps'], 1)} | "
              f"{ratio('prompt_tps')} | {fmt(r['gen_tps'], 1)} | {ratio('gen_tps')} | {same} |")
        if args.json:
            print(json.dumps(r), file=sys.stderr)
    if args.ab > 0:
        print()
        ab(args, holder)


if __name__ == "__main__":
    main()
