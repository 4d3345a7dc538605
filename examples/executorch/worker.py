#!/usr/bin/env python3
"""An ExecuTorch worker: loads a .pte, runs a fixed input, prints one JSON line.

    python worker.py MODEL.pte [--method forward] [--packd] [--hold SECONDS]

  --packd        turn packd on first (import packd.executorch; packd.executorch.enable())
  --method M     the method to load and run (default: every method of the program)
  --start-at T   wait until the epoch time T before loading (to start workers at once);
                 `stdin`: print {"armed": PID} and read T from standard input
                 (examples/together.py)
  --hold S       stay alive S seconds after printing (memory measurements)
  --settle       with --packd: print once packd accepted or refused what this worker built
                 (up to 30 s), so that the status is final

Prints: model, methods, load_ms (load_method summed over the methods), load_start (its
epoch time), load_cpu_ms (the CPU time of the whole process meanwhile), run_ms (the first
execute of each method, summed: what a worker's first request waits for), output_sha256 (of
every output's bytes), pid, and with --packd the status of packd's adoption (served, built,
private, reasons, bytes_packed, ...). The input is fixed (seeded), so two runs of one model
print the same output_sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import together  # noqa: E402  (examples/together.py: the start gate of the benchmarks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--method", action="append")
    p.add_argument("--packd", action="store_true")
    p.add_argument("--start-at")
    p.add_argument("--hold", type=float, default=0.0)
    p.add_argument("--settle", action="store_true")
    a = p.parse_args()
    if a.packd:
        import packd.executorch

        packd.executorch.enable()
    import torch
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(a.model)
    methods = a.method or sorted(program.method_names)
    together.wait(a.start_at)
    digest = hashlib.sha256()
    load_ms = cpu_ms = run_ms = 0.0
    load_start = time.time()
    for name in methods:
        t0, c0 = time.perf_counter(), time.process_time()
        method = program.load_method(name)
        load_ms += (time.perf_counter() - t0) * 1e3
        cpu_ms += (time.process_time() - c0) * 1e3
        meta = method.metadata
        inputs = []
        g = torch.Generator().manual_seed(7)
        for i in range(meta.num_inputs()):
            shape = tuple(meta.input_tensor_meta(i).sizes())
            inputs.append(torch.randn(shape, generator=g))
        t0 = time.perf_counter()
        outputs = method.execute(inputs)
        run_ms += (time.perf_counter() - t0) * 1e3
        for out in outputs:
            digest.update(out.contiguous().numpy().tobytes())
    line = {"model": os.path.basename(a.model), "methods": methods, "load_ms": round(load_ms, 3),
            "load_start": load_start, "load_cpu_ms": round(cpu_ms, 3), "run_ms": round(run_ms, 3),
            "output_sha256": digest.hexdigest(), "pid": os.getpid()}
    if a.packd:
        import packd.executorch

        status = packd.executorch.status()
        deadline = time.time() + 30
        # A build counts as built until its publication ends (publish_us is its time).
        while a.settle and status["built"] and not status["publish_us"] and time.time() < deadline:
            time.sleep(0.01)
            status = packd.executorch.status()
        line["packd"] = status
    print(json.dumps(line), flush=True)
    if a.hold:
        time.sleep(a.hold)


if __name__ == "__main__":
    sys.exit(main())
