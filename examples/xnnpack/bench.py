#!/usr/bin/env python3
"""XNNPACK workers over packd against XNNPACK's own cache, measured in the same run.

Two networks: MiniLM's 37 fully-connected layers (examples/xnnpack/minilm-fc, --model
model.safetensors, per --dtypes) or, with --net convnet, a small convolutional network
(examples/xnnpack/ops-worker --op convnet-f32: 3×3 convolution 32→64, 3×3 depthwise, 1×1
64→64, fully connected 1024→768 and 768→3072; its weights are written by this script, 13 MB).
XNNPACK_ROOT picks the XNNPACK (fetch-xnnpack: 2024-11; fetch-xnnpack-current: current).
For each dtype and each N in --workers, against a fresh packd each time:

* memory: N workers of examples/xnnpack/minilm-fc held alive together; the sum over them of
  the Pss of the packed weights, against one copy. With packd the packed weights are the
  published memfd's mapping (`/memfd:packd-xnnpack`); with --private they are anonymous
  memory in each process, counted as the worker's anonymous Pss minus that of a worker
  served by packd in the same run (which holds everything else the private one does).
* time: ready_ms (from the start of main to a runtime ready to run) of the first worker
  (it builds and publishes) and of workers 2..N (they are served), against --private
  workers (XNNPACK packs in process), medians.

    XNNPACK_ROOT=... examples/xnnpack/bench.py --model model.safetensors [--workers 1,2,4,8]
        [--dtypes f32,f16,qd8] [--runs 5] [--packd target/release/packd] [--json]
    XNNPACK_ROOT=... examples/xnnpack/bench.py --net convnet [--workers 1,2,4,8] ...
"""

import argparse
import json
import os
import shutil
import signal
import random
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def smaps_pss(pid):
    """Pss in bytes of each mapping of pid: [(name, pss)]."""
    out, name = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                parts = line.split()
                name = parts[5] if len(parts) > 5 else ""
            elif first == "Pss:":
                out.append((name, int(line.split()[1]) * 1024))
    return out


def shared_pss(pid):
    return sum(p for n, p in smaps_pss(pid) if "packd-xnnpack" in n)


def anon_pss(pid):
    return sum(p for n, p in smaps_pss(pid) if n in ("", "[heap]"))


class Daemon:
    def __init__(self, packd):
        self.dir = tempfile.mkdtemp(prefix="packd-xnn-bench-")
        self.log = open(os.path.join(self.dir, "packd.log"), "w")
        # A fresh daemon every time: no cache directory (a restart would serve the last run).
        self.proc = subprocess.Popen([packd, "--socket-dir", self.dir, "--cache-dir", "off"], stdout=subprocess.DEVNULL,
                                     stderr=self.log)
        for _ in range(200):
            if os.path.exists(os.path.join(self.dir, "packd.sock")):
                return
            time.sleep(0.05)
        raise SystemExit("packd did not start; see " + self.log.name)

    def close(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


NET = "minilm"


def convnet_model(path):
    """The convnet's weights (f32, values in [-1, 1)) as a safetensors file."""
    shapes = [("net.conv.weight", [64, 3, 3, 32]), ("net.conv.bias", [64]), ("net.dw.weight", [1, 3, 3, 64]),
              ("net.dw.bias", [64]), ("net.pw.weight", [64, 1, 1, 64]), ("net.pw.bias", [64]),
              ("net.fc1.weight", [768, 1024]), ("net.fc1.bias", [768]), ("net.fc2.weight", [3072, 768]),
              ("net.fc2.bias", [3072])]
    rng = random.Random(1)
    header, blobs, at = {}, [], 0
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        blob = struct.pack(f"<{n}f", *(rng.uniform(-1, 1) for _ in range(n)))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def start(sock, model, dtype, extra=(), hold=0):
    if NET == "convnet":
        cmd = [os.path.join(HERE, "ops-worker"), "--socket-dir", sock, "--model", model, "--op", "convnet-f32", *extra]
    else:
        cmd = [os.path.join(HERE, "minilm-fc"), "--socket-dir", sock, "--model", model, "--dtype", dtype, *extra]
    if hold:
        cmd += ["--hold", str(hold)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        raise SystemExit(f"{cmd[0]} {' '.join(extra)} printed nothing (exit {p.wait()})")
    return p, json.loads(line)


def run(args):
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in lscpu.splitlines() if l.startswith("Flags")), [])
    isa = "avx512" if "avx512f" in flags else ("avx2" if "avx2" in flags else "other")
    report = {"cpu": cpu, "isa": isa, "net": NET, "xnnpack_root": os.environ["XNNPACK_ROOT"], "rows": []}
    for dtype in args.dtypes.split(","):
        # Time: medians over runs, each with a fresh daemon (so the first worker builds).
        first, later, private = [], [], []
        for _ in range(args.runs):
            d = Daemon(args.packd)
            try:
                # The model's raw weights are packed first (as identity), so the first worker
                # pays for XNNPACK's packing through packd, not for packd's first map.
                start(d.dir, args.model, dtype, ["--no-cache"])[0].wait()
                _, p0 = start(d.dir, args.model, dtype, ["--private"])
                _, b = start(d.dir, args.model, dtype)
                assert b["cache"] == "published", b
                first.append(b["ready_ms"])
                for _ in range(2):
                    _, s = start(d.dir, args.model, dtype)
                    assert s["cache"] == "served" and s["reserve_space"] == 0, s
                    later.append(s["ready_ms"])
                _, p = start(d.dir, args.model, dtype, ["--private"])
                private += [p0["ready_ms"], p["ready_ms"]]
                digest = {b["output_blake3"], s["output_blake3"], p["output_blake3"]}
                assert len(digest) == 1, digest
            finally:
                d.close()
        # The first worker against XNNPACK packing alone: private workers run just before and
        # after it on the same daemon, the model mapped already as it is for the builder.
        row = {"dtype": dtype, "ready_first_ms": statistics.median(first),
               "ready_later_ms": statistics.median(later), "ready_private_ms": statistics.median(private)}
        row["first_over_private"] = row["ready_first_ms"] / row["ready_private_ms"]
        row["private_over_later"] = row["ready_private_ms"] / row["ready_later_ms"]
        # Memory.
        row["memory"] = []
        for n in [int(x) for x in args.workers.split(",")]:
            d = Daemon(args.packd)
            procs = []
            try:
                procs.append(start(d.dir, args.model, dtype, hold=600))
                procs += [start(d.dir, args.model, dtype, hold=600) for _ in range(n - 1)]
                one = procs[0][1]["bytes_shared"]
                shared = sum(shared_pss(p.pid) for p, _ in procs)
                served_anon = [anon_pss(p.pid) for p, v in procs if v["cache"] == "served"]
                privs = [start(d.dir, args.model, dtype, ["--private"], hold=600) for _ in range(n)]
                procs += privs
                packed_private = privs[0][1]["bytes_packed"]
                if not served_anon:
                    extra = start(d.dir, args.model, dtype, hold=600)
                    procs.append(extra)
                    served_anon = [anon_pss(extra[0].pid)]
                base = statistics.median(served_anon)
                private = sum(max(0, anon_pss(p.pid) - base) for p, _ in privs)
                row["memory"].append({"workers": n, "one_copy_bytes": one, "packd_sum_pss": shared,
                                      "packd_ratio": shared / one, "private_sum_pss": private,
                                      "private_ratio": private / packed_private})
            finally:
                for p, _ in procs:
                    p.kill()
                    p.wait()
                d.close()
        report["rows"].append(row)
    return report


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", choices=["minilm", "convnet"], default="minilm")
    ap.add_argument("--model", help="MiniLM's model.safetensors (--net minilm)")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--dtypes", default="f32,f16,qd8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--packd", default=os.path.join(REPO, "target", "release", "packd"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if "XNNPACK_ROOT" not in os.environ:
        raise SystemExit("set XNNPACK_ROOT (examples/xnnpack/fetch-xnnpack prints one)")
    global NET
    NET = args.net
    scratch = None
    if NET == "convnet":
        scratch = tempfile.mkdtemp(prefix="packd-convnet-")
        args.model = os.path.join(scratch, "convnet.safetensors")
        args.dtypes = "f32"
        convnet_model(args.model)
    elif not args.model:
        raise SystemExit("--model model.safetensors is required for --net minilm")
    try:
        report = run(args)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"CPU: {report['cpu']} ({report['isa']}); net: {report['net']}; XNNPACK: {report['xnnpack_root']}")
    print("| dtype | first worker ready (ms) | XNNPACK alone (--private) | first / alone | workers 2..N ready (ms) | alone / later |")
    print("|---|---|---|---|---|---|")
    for r in report["rows"]:
        print(f"| {r['dtype']} | {r['ready_first_ms']:.1f} | {r['ready_private_ms']:.1f} | {r['first_over_private']:.2f} × "
              f"| {r['ready_later_ms']:.2f} | {r['private_over_later']:.1f} × |")
    print()
    print("| dtype | N | one copy (MB) | Σ Pss packd (MB) | packd / one copy | Σ Pss --private (MB) | --private / one copy |")
    print("|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        for m in r["memory"]:
            print(f"| {r['dtype']} | {m['workers']} | {m['one_copy_bytes'] / 1e6:.1f} | {m['packd_sum_pss'] / 1e6:.1f} "
                  f"| {m['packd_ratio']:.2f} × | {m['private_sum_pss'] / 1e6:.1f} | {m['private_ratio']:.2f} × |")


if __name__ == "__main__":
    sys.exit(main())
