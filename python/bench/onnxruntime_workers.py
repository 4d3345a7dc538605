#!/usr/bin/env python3
"""Memory and time to ready of N ONNX Runtime worker processes embedding with
all-MiniLM-L6-v2 (examples/python/onnxruntime_minilm.py), weights from packd against
weights loaded privately, with ONNX Runtime's pre-packing on and off.

    python3 python/bench/onnxruntime_workers.py MODEL_DIR [--procs 1,2,4] [--socket-dir DIR]

Each worker measures its own proportional set size (Pss, /proc/self/smaps_rollup) after its
imports, then loads the weights, builds its session and embeds once ("ready"), and reports
the time that took. With all N workers alive, the parent reads every worker's Pss again:
the sum of the growth is what the N workers hold for weights and sessions, shared pages
counted once in total (that is what Pss is for); the part inside packd's mappings is
reported separately. Then each worker measures embeddings per second (batches of 8
sentences, one intra-op thread), one worker at a time. Needs a running packd, numpy,
onnx, onnxruntime, tokenizers and the packd package.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
             "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums."]


def pss_kib(pid="self"):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def packd_pss_kib(pid):
    """Pss of the mappings of packd's segments in process `pid`."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and not first.endswith(":"):
                inside = "/memfd:packd:" in line
            elif inside and line.startswith("Pss:"):
                total += int(line.split()[1])
    return total


def worker(args):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "python"))
    import onnxruntime_minilm as mini
    before = pss_kib()
    t = time.perf_counter()
    model = pathlib.Path(args.model_dir) / "model.safetensors"
    weights = mini.packd_weights(model, args.socket_dir) if args.mode == "packd" else mini.read_safetensors(model)
    e = mini.Embedder(weights, pathlib.Path(args.model_dir) / "tokenizer.json", prepacking=args.prepacking == "on")
    e.embed(SENTENCES[:1])
    ready = time.perf_counter() - t
    print(json.dumps({"before_kib": before, "ready_s": ready}), flush=True)
    sys.stdin.readline()  # the parent has measured everyone's memory
    runs = []
    for _ in range(args.runs):
        t = time.perf_counter()
        e.embed(SENTENCES)
        runs.append(time.perf_counter() - t)
    runs.sort()
    print(json.dumps({"embeddings_per_s": len(SENTENCES) / runs[len(runs) // 2]}), flush=True)


def run(args, mode, prepacking, n):
    cmd = [sys.executable, __file__, args.model_dir, "--worker", "--mode", mode, "--prepacking", prepacking,
           "--runs", str(args.runs)]
    if args.socket_dir:
        cmd += ["--socket-dir", args.socket_dir]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    first = [json.loads(p.stdout.readline()) for p in procs]
    grown = sum(pss_kib(p.pid) - f["before_kib"] for p, f in zip(procs, first))
    shared = sum(packd_pss_kib(p.pid) for p in procs)
    speeds = []
    for p in procs:  # one at a time, so that they do not share the cores
        p.stdin.write("go\n")
        p.stdin.flush()
        speeds.append(json.loads(p.stdout.readline())["embeddings_per_s"])
        p.wait()
    return {"mode": mode, "prepacking": prepacking, "procs": n, "pss_growth_mib": grown / 1024,
            "pss_in_packd_mib": shared / 1024, "ready_s": [f["ready_s"] for f in first],
            "embeddings_per_s": sorted(speeds)[len(speeds) // 2]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--socket-dir", default=None)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="packd", help=argparse.SUPPRESS)
    ap.add_argument("--prepacking", default="on", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import packd
    one_copy = packd.Client(args.socket_dir).pack(pathlib.Path(args.model_dir) / "model.safetensors",
                                                  layout="identity").size / 2**20
    rows = []
    for prepacking in ("off", "on"):
        for n in [int(x) for x in args.procs.split(",")]:
            for mode in ("packd", "private"):
                rows.append(run(args, mode, prepacking, n))
    if args.json:
        print(json.dumps({"one_copy_mib": one_copy, "rows": rows}))
        return
    print(f"one copy of the weights: {one_copy:.1f} MiB (packd's identity segment)")
    print(f"{'prepack':>7} {'procs':>5} {'weights':>8} {'Σ Pss growth':>13} {'× one copy':>10} "
          f"{'in packd maps':>13} {'ready, median':>14} {'emb/s':>7}")
    for r in rows:
        ready = sorted(r["ready_s"])[len(r["ready_s"]) // 2]
        print(f"{r['prepacking']:>7} {r['procs']:>5} {r['mode']:>8} {r['pss_growth_mib']:>10.1f} MiB "
              f"{r['pss_growth_mib'] / one_copy:>10.2f} {r['pss_in_packd_mib']:>9.1f} MiB "
              f"{ready * 1e3:>11.0f} ms {r['embeddings_per_s']:>7.0f}")


if __name__ == "__main__":
    main()
