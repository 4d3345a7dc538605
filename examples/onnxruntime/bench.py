#!/usr/bin/env python3
"""ONNX Runtime workers side by side: N workers started together on a model nobody built yet,
on a quiet host and beside CPU-bound processes, as ONNX Runtime runs them by default
(pre-packing on), through ONNX Runtime's own disk route, and with packd.

    python bench.py MODEL.onnx [--workers 1,4,8] [--rounds 3] [--load quiet,busy] [--busy 2]
                    [--packd PATH] [--packd-b PATH] [--b-env NAME=VALUE] [--runs 50]

Modes:
  default  every worker loads the model and prepacks privately (ONNX Runtime's default);
  disk     ONNX Runtime's own route: one process writes the optimized model with its weights
           and prepacked blobs as external data to a directory (its time is `write_s`, not
           counted in the workers'), then the N workers load that model, which ONNX Runtime
           maps;
  packd    `packd.onnxruntime.enable()` in every worker, a fresh daemon each round (no cache
           directory): one worker builds, the others wait, every worker maps packd's copy;
  packd-b  the same with another packd binary (--packd-b: an A/B of two daemons in one run),
           or with --b-env NAME=VALUE in the workers' environment (e.g. PACKD_PROVISIONAL_NAMES=off).

Each round starts N workers (worker.py, one thread each) that import ONNX Runtime, then create
their session at one instant once all have imported (examples/together.py), run one
inference and hold; while they hold, their memory is read from /proc. Modes alternate within
a round. Prints one JSON line per
load, mode and N (medians over rounds) and a Markdown table:

- `weights_pss_mib`: Σ Pss of the weights and prepacks over the workers (and the daemon): the
  mappings of the data file (disk) or of packd's memfd (packd); for default, Σ Pss_Anon of the
  workers less that of the packd workers of the same round (who hold neither privately);
- `copies`: that over the size of one copy (the data file, or packd's publication);
- `first_s`, `others_s`, `slowest_s`: seconds from the common start to the first inference's
  result: the builder (packd) or the first ready, the median of the others, the slowest;
  `x` columns: over the default's median worker of the same round;
- `wrong`, `failed`: workers whose output differs from ONNX Runtime alone, or that died.

With --runs K (quiet load, N = 1 only), each mode's worker runs K more inferences and
`runs_per_s` compares throughput (medians over rounds).
"""

import argparse
import importlib.util
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


def _litert_bench():
    """The LiteRT bench beside this one, for its reading of /proc/PID/smaps."""
    spec = importlib.util.spec_from_file_location("litert_bench", HERE.parent / "litert" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


smaps = _litert_bench().smaps  # (Pss of the mappings a path test picks, Pss_Anon, Pss) of a pid


def write_disk_route(model, out):
    """ONNX Runtime's own route: the optimized model with weights and prepacks as external data."""
    code = f"""
import onnxruntime as ort
o = ort.SessionOptions()
o.intra_op_num_threads = 1
o.log_severity_level = 3
o.optimized_model_filepath = {str(out / 'model.onnx')!r}
o.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model.data")
o.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
o.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
ort.InferenceSession({str(model)!r}, o, providers=["CPUExecutionProvider"])
"""
    t = time.time()
    subprocess.run([sys.executable, "-c", code], check=True)
    return out / "model.onnx", out / "model.data", time.time() - t


B_ENV = {}


def round_of(mode, n, model, busy, packd_bin, reference, runs):
    env = dict(os.environ)
    if mode == "packd-b":
        packd_bin, mode = packd_bin[1] or packd_bin[0], "packd"
        env.update(B_ENV)
    elif mode == "packd":
        packd_bin = packd_bin[0]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="packd-ort-bench-"))
    daemon = None
    args, target, write_s = [], model, None
    data = None
    if mode == "disk":
        target, data, write_s = write_disk_route(model, tmp)
    elif mode == "packd":
        env["PACKD_SOCKET_DIR"] = str(tmp / "run")
        env["PACKD_NAMES"] = str(tmp / "names")
        daemon = subprocess.Popen([packd_bin, "--socket-dir", str(tmp / "run"), "--cache-dir", "off", "--fd-store",
                                   "off"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while not (tmp / "run" / "packd.sock").exists():
            assert time.time() < deadline and daemon.poll() is None, "packd did not start"
            time.sleep(0.02)
        args = ["--packd"]
    if runs:
        args += ["--runs", str(runs)]
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "worker.py"), str(target), "--hold", "--start-at",
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
        match = lambda path: path.startswith("/memfd:packd-onnxruntime")  # noqa: E731
    else:
        match = lambda path: data is not None and path == str(data)  # noqa: E731
    pss = anon = whole = 0
    for p in procs:
        a, b, c = smaps(p.pid, match)
        pss, anon, whole = pss + a, anon + b, whole + c
    if daemon is not None:
        a, _, c = smaps(daemon.pid, match)
        pss, whole = pss + a, whole + c
    size = data.stat().st_size if data is not None else 0
    if mode == "packd":
        size = max((x["packd"]["bytes_shared"] for x in lines if x and x.get("packd")), default=0)
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
    ok = [x for x in lines if x and "output_sha256" in x]
    ready = [x["ready_s"] for x in ok]
    builders = [x["ready_s"] for x in ok if mode == "packd" and x["packd"]["built"]]
    first = builders[0] if len(builders) == 1 else min(ready, default=0.0)
    others = sorted(ready)
    others.remove(first) if first in others else None
    return {
        "pss": pss, "anon": anon, "whole": whole, "size": size, "write_s": write_s,
        "first_s": first, "others_s": statistics.median(others) if others else None,
        "slowest_s": max(ready, default=0.0), "median_s": statistics.median(ready) if ready else None,
        "built": sum(1 for x in ok if x.get("packd") and x["packd"]["built"]),
        "private": sum(1 for x in ok if x.get("packd") and x["packd"]["private"]),
        "runs_per_s": statistics.median(x["runs_per_s"] for x in ok) if runs and ok else None,
        "wrong": sum(1 for x in ok if x["output_sha256"] != reference),
        "failed": sum(1 for p, x in zip(procs, lines) if p.returncode or not x or "output_sha256" not in x),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--workers", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--load", default="quiet,busy")
    ap.add_argument("--busy", type=int, default=2, help="CPU-bound processes at nice 0 beside the workers")
    ap.add_argument("--packd", default=shutil.which("packd") or "target/release/packd", help="the packd binary")
    ap.add_argument("--packd-b", default=None, help="a second packd binary, run as the mode packd-b")
    ap.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE",
                    help="run the mode packd-b (with --packd unless --packd-b) with these in the workers' environment")
    ap.add_argument("--runs", type=int, default=0, help="throughput A/B: inferences after the first (N = 1, quiet)")
    a = ap.parse_args()
    ref = subprocess.run([sys.executable, str(HERE / "worker.py"), a.model], capture_output=True, text=True, check=True)
    reference = json.loads(ref.stdout.strip().splitlines()[-1])["output_sha256"]
    B_ENV.update(kv.split("=", 1) for kv in a.b_env)
    modes = ("default", "disk", "packd") + (("packd-b",) if a.packd_b or a.b_env else ())
    rows = []
    for load in a.load.split(","):
        busy = a.busy if load == "busy" else 0
        for n in [int(x) for x in a.workers.split(",")]:
            runs = a.runs if (n == 1 and load == "quiet") else 0
            results = {m: [] for m in modes}
            for r in range(a.rounds):
                order = modes if r % 2 == 0 else tuple(reversed(modes))
                got = {m: round_of(m, n, a.model, busy, (a.packd, a.packd_b), reference, runs) for m in order}
                base = got["default"]["median_s"]
                for m in modes:
                    got[m]["first_x"] = got[m]["first_s"] / base
                    got[m]["slowest_x"] = got[m]["slowest_s"] / base
                    got[m]["others_x"] = got[m]["others_s"] / base if got[m]["others_s"] else None
                    got[m]["weights"] = (max(0, got[m]["anon"] - got["packd"]["anon"]) if m == "default"
                                         else got[m]["pss"])
                    results[m].append(got[m])
            size = statistics.median(x["size"] for x in results["packd"] + results["disk"] if x["size"])
            med = lambda rs, k: (statistics.median(x[k] for x in rs if x[k] is not None)  # noqa: E731
                                 if any(x[k] is not None for x in rs) else None)
            for m in modes:
                rs = results[m]
                row = {"load": load, "mode": m, "workers": n, "rounds": len(rs), "one_copy_mib": size / 2**20,
                       "weights_pss_mib": med(rs, "weights") / 2**20, "copies": med(rs, "weights") / size,
                       "whole_pss_mib": med(rs, "whole") / 2**20,
                       **{k: med(rs, k) for k in ("first_s", "others_s", "slowest_s", "first_x", "others_x",
                                                   "slowest_x", "write_s", "runs_per_s")},
                       "built": [x["built"] for x in rs], "private": [x["private"] for x in rs],
                       "wrong": sum(x["wrong"] for x in rs), "failed": sum(x["failed"] for x in rs)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    f = lambda v, spec=".2f": "—" if v is None else format(v, spec)  # noqa: E731
    print("\n| load | N | mode | Σ Pss weights+prepacks (MiB) | copies | Σ Pss workers (MiB) | first ready s (×) "
          "| others s (×) | slowest × | runs/s | wrong / failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['load']} | {r['workers']} | {r['mode']} | {r['weights_pss_mib']:.1f} | {r['copies']:.2f} "
              f"| {r['whole_pss_mib']:.0f} | {f(r['first_s'], '.3f')} ({f(r['first_x'])}) "
              f"| {f(r['others_s'], '.3f')} ({f(r['others_x'])}) | {f(r['slowest_x'])} | {f(r['runs_per_s'], '.1f')} "
              f"| {r['wrong']} / {r['failed']} |")


if __name__ == "__main__":
    main()
