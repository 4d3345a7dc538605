#!/usr/bin/env python3
"""An ONNX Runtime worker: creates an `InferenceSession` on the CPU, runs one inference on a
fixed input, and prints one JSON line.

    python worker.py MODEL.onnx [--packd] [--bytes] [--providers P,...] [--no-prepacking]
                     [--start-at EPOCH|stdin] [--runs K] [--sessions K] [--hold]

--packd          turn packd on first (`packd.onnxruntime.enable()`): the one line a worker adds
--bytes          create the session from the model's bytes
--providers      the execution providers to ask for (default: CPUExecutionProvider)
--no-prepacking  session.disable_prepacking=1 (ONNX Runtime's route to one copy without packd)
--start-at       sleep until this time (seconds since the epoch) after the imports, so that
                 workers started together create their sessions together; `stdin`: print
                 {"armed": PID} and read the time from standard input (examples/together.py)
--runs K         after the first inference, run K more and report `runs_per_s`
--sessions K     create K sessions of the model at once, from K threads (one output each,
                 all reported in `outputs_sha256`)
--hold           after printing, wait until standard input closes (to measure memory)

The line has: `output_sha256` of the first output of the first inference, `ready_s` (session
and first inference, from `start`: the moment the worker went on after --start-at or the
imports), `session_s`, the worker's `pid`, `packd` (`packd.onnxruntime.status()`, or null),
`memfd` (the device:inode of the packd memory the process maps, or null), `rss_anon_kib`
after the inference, and on a failure `error`.
"""

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import together  # noqa: E402  (examples/together.py: the start gate of the benchmarks)


def inputs_for(session, np):
    """A fixed input for every model input: token ids and masks for int64, seeded normal floats."""
    rng = np.random.default_rng(3)
    feed = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else (2 if n == 0 else 16) for n, d in enumerate(i.shape)]
        if i.type == "tensor(int64)":
            feed[i.name] = np.ones(shape, np.int64) if "mask" in i.name else rng.integers(100, 2000, shape)
        else:
            feed[i.name] = rng.standard_normal(shape).astype(np.float32)
    return feed


def packd_memfds():
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/memfd:packd"):
                out.add(parts[3] + ":" + parts[4])
    return sorted(out)


def rss_anon_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--packd", action="store_true")
    p.add_argument("--bytes", action="store_true")
    p.add_argument("--providers", default="CPUExecutionProvider")
    p.add_argument("--no-prepacking", action="store_true")
    p.add_argument("--start-at")
    p.add_argument("--runs", type=int, default=0)
    p.add_argument("--sessions", type=int, default=1)
    p.add_argument("--hold", action="store_true")
    a = p.parse_args()

    import numpy as np

    if a.packd:
        import packd.onnxruntime

        packd.onnxruntime.enable()
    import onnxruntime as ort

    t0 = together.wait(a.start_at)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if a.no_prepacking:
        options.add_session_config_entry("session.disable_prepacking", "1")
    out = {"pid": os.getpid(), "start": t0}
    try:
        model = open(a.model, "rb").read() if a.bytes else a.model
        if a.sessions > 1:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(a.sessions) as pool:
                sessions = list(pool.map(lambda _: ort.InferenceSession(model, options,
                                                                        providers=a.providers.split(",")),
                                         range(a.sessions)))
            outs = [s.run(None, inputs_for(s, np))[0] for s in sessions]
            out["outputs_sha256"] = [hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest() for y in outs]
            session = sessions[0]
        else:
            session = ort.InferenceSession(model, options, providers=a.providers.split(","))
        out["session_s"] = time.time() - t0
        feed = inputs_for(session, np)
        y = session.run(None, feed)[0]
        out["ready_s"] = time.time() - t0
        out["output_sha256"] = hashlib.sha256(np.ascontiguousarray(y).tobytes()).hexdigest()
        if a.runs:
            t = time.perf_counter()
            for _ in range(a.runs):
                session.run(None, feed)
            out["runs_per_s"] = a.runs / (time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001 - the line says what failed
        out["error"] = f"{type(e).__name__}: {e}"
    out["memfd"] = packd_memfds()
    out["rss_anon_kib"] = rss_anon_kib()
    out["packd"] = packd.onnxruntime.status() if a.packd else None
    print(json.dumps(out), flush=True)
    if a.hold:
        sys.stdin.read()


if __name__ == "__main__":
    main()
