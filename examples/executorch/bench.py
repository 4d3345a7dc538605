#!/usr/bin/env python3
"""ExecuTorch workers side by side, N started at once: as the wheel ships them (every worker
packs privately), with ExecuTorch's own packed-weights file (`packed_cache_path`, through
examples/executorch/etcache.cpp, a C++ runner built here against the wheel: the option is
not reachable from Python), and through packd (packd.executorch.enable()).

    python bench.py MODEL.pte [--workers 1,2,4,8] [--runs 3] [--packd-bin target/release/packd]

Per configuration and N (each packd run on a fresh daemon with no cache directory):
  load1_ms      load_method of the worker that packed (packd: the builder; the file cache: the
                worker that wrote the file; private: the median worker)
  load_rest_ms  median load_method of the other workers (started at the same moment)
  load_later_ms load_method of one more worker started once the N are ready
  private       workers that packed privately
  pss_weights   memory of the packed weights on the host (packd: the allocated bytes of the
                segment packd holds, one copy whether or not workers touched it; the file cache: the file's mappings' Pss plus the bytes of
                each worker that packed privately; private: N × the bytes XNNPACK packed,
                which each worker holds in its heap)
  pss_workers   Σ Pss of the whole workers (torch included in the Python ones; the C++ runner
                of the file cache carries no torch, so its figure is not comparable)
Figures are medians over --runs; ratios are against the private configuration of the same
N in the same run. Prints a Markdown table and, with --json, one JSON line per row.
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import together  # noqa: E402  (examples/together.py)

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def pss(pid: int, match=None) -> int:
    """Pss in bytes of a process (or of its mappings whose path contains `match`)."""
    if match is None:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
        return 0
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                inside = match in line
            elif inside and first == "Pss:":
                total += int(line.split()[1]) * 1024
    return total


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


def etcache_bin() -> str:
    """Builds the C++ runner against the wheel of this Python's ExecuTorch (once)."""
    import executorch
    import torch

    et = pathlib.Path(list(executorch.__path__)[0])
    out = ROOT / "target" / "executorch-example" / "etcache"
    src = HERE / "etcache.cpp"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["g++", "-std=c++17", "-O2", "-Wno-deprecated-declarations", f"-I{et / 'include'}",
                        f"-idirafter{pathlib.Path(torch.__file__).parent / 'include'}", str(src), "-o", str(out),
                        f"-L{et / 'lib'}", "-Wl,--no-as-needed", "-lexecutorch_backend_xnnpack", "-lexecutorch",
                        f"-Wl,-rpath,{et / 'lib'}"], check=True)
    return str(out)


def run_etcache(pte: str, n: int, cache_file: str, hold: float, packed: int):
    start = time.time() + 1.0 + 0.2 * n
    binary = etcache_bin()
    procs = [subprocess.Popen([binary, pte, cache_file, str(start), str(hold)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(n)]
    lines = [json.loads(p.stdout.readline()) for p in procs]
    time.sleep(0.5)
    whole = sum(pss(p.pid) for p in procs)
    mapped = sum(pss(p.pid, os.path.basename(cache_file)) for p in procs)
    out = subprocess.run([binary, pte, cache_file], capture_output=True, text=True).stdout
    later = json.loads(out.strip().splitlines()[-1])["load_ms"]
    for p in procs:
        p.kill()
    errs = [p.communicate()[1] for p in procs]
    for line, err in zip(lines, errs):
        line["private"] = "flock(" in err
        line["wrote"] = "Saved packed weight index" in err
    private = sum(1 for x in lines if x["private"])
    return lines, whole, mapped + private * packed, private, later


def segment_bytes(daemon_pid: int) -> int:
    """Memory held by the XNNPACK segments packd holds (their memfds' allocated bytes):
    one copy, whether or not a worker has touched its pages yet."""
    total = 0
    fds = f"/proc/{daemon_pid}/fd"
    for fd in os.listdir(fds):
        try:
            if "packd-xnnpack" in os.readlink(f"{fds}/{fd}"):
                total += os.stat(f"{fds}/{fd}").st_blocks * 512
        except OSError:
            pass
    return total


def run(pte: str, n: int, packd_sock, hold: float, daemon_pid=None):
    env = dict(os.environ)
    cmd = [sys.executable, str(HERE / "worker.py"), pte, "--hold", str(hold)]
    if packd_sock:
        env["PACKD_SOCKET_DIR"] = packd_sock
        cmd.append("--packd")
    procs = [subprocess.Popen(cmd + ["--start-at", "stdin"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(n)]
    together.start(procs)
    lines = [json.loads(p.stdout.readline()) for p in procs]
    time.sleep(0.5)
    whole = sum(pss(p.pid) for p in procs)
    shared = segment_bytes(daemon_pid) if daemon_pid else 0
    # One more worker, started once the others are ready.
    out = subprocess.run(cmd[:3] + cmd[5:], env=env, capture_output=True, text=True).stdout
    later = json.loads(out.strip().splitlines()[-1])["load_ms"]
    for p in procs:
        p.kill()
        p.wait()
    return lines, whole, shared, later


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pte")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hold", type=float, default=60.0, help="seconds workers stay alive at most")
    ap.add_argument("--packd-bin", default=str(ROOT / "target" / "release" / "packd"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    for n in [int(x) for x in a.workers.split(",")]:
        per = {}
        for config in ["private", "packd", "etcache"]:
            samples = []
            for _ in range(a.runs):
                if config == "etcache":
                    with tempfile.TemporaryDirectory() as tmp:
                        packed_bytes = per["packd"]["packed"]
                        lines, whole, weights, private, later = run_etcache(
                            a.pte, n, os.path.join(tmp, "packed.bin"), a.hold, packed_bytes)
                    writers = [x for x in lines if x["wrote"]]
                    first = writers[0] if writers else lines[0]
                    rest = [x for x in lines if x is not first]
                    packed = None
                elif config == "packd":
                    with tempfile.TemporaryDirectory() as tmp:
                        proc, sock = daemon(a.packd_bin, tmp)
                        try:
                            lines, whole, shared, later = run(a.pte, n, sock, a.hold, proc.pid)
                        finally:
                            proc.kill()
                            proc.wait()
                    builders = [x for x in lines if x["packd"]["built"] > 0]
                    first = builders[0] if builders else lines[0]
                    rest = [x for x in lines if x is not first]
                    private = sum(1 for x in lines if x["packd"]["bytes_packed"] > 0 and x is not first)
                    packed = first["packd"]["bytes_packed"]
                    weights = shared
                else:
                    lines, whole, _, later = run(a.pte, n, None, a.hold)
                    ordered = sorted(lines, key=lambda x: x["load_ms"])
                    first, rest = ordered[len(ordered) // 2], [x for x in lines if x is not ordered[len(ordered) // 2]]
                    private, packed, weights = n, None, None
                samples.append({
                    "load1_ms": first["load_ms"],
                    "load_rest_ms": statistics.median([x["load_ms"] for x in rest]) if rest else None,
                    "load_later_ms": later,
                    "private": private,
                    "packed": packed,
                    "pss_weights": weights,
                    "pss_workers": whole,
                })
            med = lambda k: (statistics.median([s[k] for s in samples]) if samples[0][k] is not None else None)  # noqa: E731
            per[config] = {k: med(k) for k in samples[0]}
        packed = per["packd"]["packed"]
        per["private"]["pss_weights"] = n * packed if packed else None
        per["private"]["private"] = n
        for config in ["private", "packd", "etcache"]:
            row = {"workers": n, "config": config, **per[config]}
            base = per["private"]
            row["load1_ratio"] = row["load1_ms"] / base["load1_ms"]
            if row["load_rest_ms"] is not None and base["load_rest_ms"]:
                row["load_rest_ratio"] = row["load_rest_ms"] / base["load_rest_ms"]
            row["load_later_ratio"] = row["load_later_ms"] / base["load_later_ms"]
            if row["pss_weights"] and packed:
                row["pss_weights_copies"] = row["pss_weights"] / packed
            row["pss_workers_ratio"] = row["pss_workers"] / base["pss_workers"]
            rows.append(row)
            if a.json:
                print(json.dumps(row), flush=True)
    mib = lambda b: "–" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    print("| N | config | load_method worker 1 | workers 2..N at once (median) | a worker started after | "
          "packed privately | Σ Pss packed weights | Σ Pss workers |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        rest = "–" if r["load_rest_ms"] is None else f"{r['load_rest_ms']:.1f} ms ({r.get('load_rest_ratio', 1):.2f}×)"
        copies = f" ({r['pss_weights_copies']:.2f} copies)" if r.get("pss_weights_copies") else ""
        later = f"{r['load_later_ms']:.1f} ms ({r['load_later_ratio']:.2f}×)"
        print(f"| {r['workers']} | {r['config']} | {r['load1_ms']:.1f} ms ({r['load1_ratio']:.2f}×) | {rest} | {later} | "
              f"{int(r['private'])} | {mib(r['pss_weights'])} MiB{copies} | {mib(r['pss_workers'])} MiB "
              f"({r['pss_workers_ratio']:.2f}×) |")


if __name__ == "__main__":
    sys.exit(main())
