#!/usr/bin/env python3
"""LiteRT workers side by side: N workers started together on a model nobody packed yet,
beside CPU-bound processes, with no weight cache, with LiteRT's own cache file shared by
all, and with packd.

    python bench.py MODEL.tflite [--workers 1,4,8] [--rounds 3] [--busy 2] [--packd PATH]

Each round starts N workers (examples/litert/worker.py, one thread each) that import LiteRT,
then compile at one instant once all have imported (examples/together.py), run one inference
and hold; while they hold, their memory is read from /proc. Every round is cold: LiteRT's cache file is deleted, packd
is a new daemon with an empty cache directory. Prints one JSON line per mode and N (medians
over the rounds) and a Markdown table:

- `weights_pss_mib`: Σ Pss of the packed weights over the workers (and the daemon): the
  cache mappings (the file, or packd's memfd). Without a cache XNNPACK packs into anonymous
  memory: there it is Σ Pss_Anon of the workers less Σ Pss_Anon of the packd workers of the
  same round count (who hold no packed weights privately);
- `copies`: that over the size of one packed copy (the cache file's size);
- `first_s`, `others_s`: seconds from the common start to the first inference's result, of
  the worker that packed (the first one ready when none or several did) and the median of
  the others;
- `packed`: workers that packed: all without a cache; with LiteRT's file, the workers that
  held it open for writing (LiteRT keeps its build's fd); with packd, the builders and the
  private ones by packd's status;
- `wrong`, `failed`: workers whose output differs from a worker without a cache, or that
  died (`exits`: their exit codes, a negative one the signal);
- `whole_pss_mib`: Σ Pss of the whole worker processes (and the daemon).
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import together  # noqa: E402  (examples/together.py)

HERE = pathlib.Path(__file__).resolve().parent


def smaps(pid, match):
    """(Pss of the mappings whose path satisfies `match`, Pss_Anon, Pss) of `pid`, in bytes."""
    pss = 0
    current = None
    try:
        text = pathlib.Path(f"/proc/{pid}/smaps").read_text()
        rollup = pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0, 0
    for line in text.splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            current = " ".join(head[5:]) if len(head) > 5 else ""
        elif line.startswith("Pss:") and current is not None and match(current):
            pss += int(head[1]) * 1024
    total = dict((line.split()[0].rstrip(":"), int(line.split()[1]) * 1024) for line in rollup.splitlines()[1:]
                 if len(line.split()) == 3)
    return pss, total.get("Pss_Anon", 0), total.get("Pss", 0)


def held_for_writing(pid, path):
    """Whether `pid` holds `path` open read-write (LiteRT keeps its build's fd)."""
    fds = pathlib.Path(f"/proc/{pid}/fd")
    try:
        for fd in fds.iterdir():
            try:
                if os.readlink(fd) == str(path):
                    flags = int(pathlib.Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text().split("flags:")[1].split()[0], 8)
                    if flags & os.O_ACCMODE != os.O_RDONLY:
                        return True
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        pass
    return False


def round_of(mode, n, model, busy, packd_bin, reference):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="packd-litert-bench-"))
    env = dict(os.environ)
    daemon = None
    args = []
    cache = tmp / "model.xnnpack_cache"
    if mode == "litert":
        args = ["--own-cache", str(cache)]
    elif mode == "packd":
        env["PACKD_SOCKET_DIR"] = str(tmp / "run")
        daemon = subprocess.Popen([packd_bin, "--socket-dir", str(tmp / "run"), "--cache-dir", str(tmp / "cache")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while not (tmp / "run" / "packd.sock").exists():
            assert time.time() < deadline and daemon.poll() is None, "packd did not start"
            time.sleep(0.02)
        args = ["--packd"]
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "worker.py"), str(model), "--hold", "--start-at",
                               "stdin", *args], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(n)]
    together.start(procs)
    lines = []
    for p in procs:
        out = p.stdout.readline()
        lines.append(json.loads(out) if out else None)
    for b in burners:
        b.kill()
        b.wait()
    if mode == "packd":
        match = lambda path: "memfd:packd-litert-cache" in path  # noqa: E731
    else:
        match = lambda path: path == str(cache)  # noqa: E731
    pss = anon = whole = 0
    packed = []
    for p, line in zip(procs, lines):
        a, b, c = smaps(p.pid, match)
        pss, anon, whole = pss + a, anon + b, whole + c
        if line is None or "output" not in line:
            packed.append(False)
        elif mode == "none":
            packed.append(True)
        elif mode == "litert":
            packed.append(held_for_writing(p.pid, cache))
        else:
            packed.append(line["packd"]["built"] + line["packd"]["private"] > 0)
    if daemon is not None:
        a, _, c = smaps(daemon.pid, match)
        pss, whole = pss + a, whole + c
    size = cache.stat().st_size if cache.exists() else 0
    if mode == "packd":
        size = max((x["packd"]["bytes_shared"] for x in lines if x and "packd" in x), default=0)
    for p in procs:
        try:
            p.stdin.close()
        except OSError:
            pass
        p.wait(timeout=120)
    if daemon is not None:
        daemon.terminate()
        daemon.wait(timeout=30)
    shutil.rmtree(tmp, ignore_errors=True)
    ok = [x for x in lines if x and "output" in x]
    ready = [x["ready_s"] for x in ok]
    builders = [x["ready_s"] for x, pk in zip(lines, packed) if pk and x and "output" in x]
    first = builders[0] if len(builders) == 1 else min(ready, default=0.0)
    others = sorted(ready)
    others.remove(first) if first in others else None
    return {
        "pss": pss,
        "anon": anon,
        "whole": whole,
        "exits": sorted(p.returncode for p in procs if p.returncode),
        "size": size,
        "first_s": first,
        "others_s": statistics.median(others) if others else None,
        "packed": sum(packed),
        "wrong": sum(1 for x in ok if x["output_sha256"] != reference),
        "failed": sum(1 for p, x in zip(procs, lines) if p.returncode or not x or "output" not in x),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--workers", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes at nice 0 beside the workers")
    ap.add_argument("--packd", default=shutil.which("packd") or "target/release/packd", help="the packd binary")
    a = ap.parse_args()
    ref = subprocess.run([sys.executable, str(HERE / "worker.py"), a.model], capture_output=True, text=True, check=True)
    reference = json.loads(ref.stdout.strip().splitlines()[-1])["output_sha256"]
    rows = []
    for n in [int(x) for x in a.workers.split(",")]:
        results = {}
        for r in range(a.rounds):
            for mode in ("none", "litert", "packd"):
                results.setdefault(mode, []).append(round_of(mode, n, a.model, a.busy, a.packd, reference))
        size = statistics.median(x["size"] for x in results["packd"] + results["litert"] if x["size"])
        for mode in ("none", "litert", "packd"):
            rs = results[mode]
            if mode == "none":
                weights = [max(0, x["anon"] - y["anon"]) for x, y in zip(rs, results["packd"])]
            else:
                weights = [x["pss"] for x in rs]
            row = {
                "mode": mode,
                "workers": n,
                "weights_pss_mib": statistics.median(weights) / 2**20,
                "copies": statistics.median(weights) / size if size else None,
                "first_s": statistics.median(x["first_s"] for x in rs),
                "others_s": statistics.median(x["others_s"] for x in rs) if n > 1 else None,
                "packed": statistics.median(x["packed"] for x in rs),
                "wrong": sum(x["wrong"] for x in rs),
                "failed": sum(x["failed"] for x in rs),
                "exits": [e for x in rs for e in x["exits"]],
                "whole_pss_mib": statistics.median(x["whole"] for x in rs) / 2**20,
                "rounds": len(rs),
                "one_copy_mib": size / 2**20,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| N | mode | Σ Pss packed weights (MiB) | copies | Σ Pss workers (MiB) | worker 1 ready (s) | others (s) "
          "| packed | wrong / failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        others = "—" if r["others_s"] is None else f"{r['others_s']:.3f}"
        print(f"| {r['workers']} | {r['mode']} | {r['weights_pss_mib']:.1f} | {r['copies']:.2f} "
              f"| {r['whole_pss_mib']:.0f} | {r['first_s']:.3f} "
              f"| {others} | {r['packed']:g} | {r['wrong']} / {r['failed']} |")


if __name__ == "__main__":
    main()
