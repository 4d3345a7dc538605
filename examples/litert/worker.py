#!/usr/bin/env python3
"""A LiteRT worker: compiles a .tflite model with `CompiledModel` on the CPU, runs one
inference on a fixed input, and prints one JSON line.

    python worker.py MODEL.tflite [--packd] [--own-cache PATH] [--buffer] [--ynnpack]
                     [--start-at EPOCH|stdin] [--hold]

--packd       turn packd on first (`packd.litert.enable()`): the one line a worker adds
--own-cache   give LiteRT a cache file of its own (`xnnpack_weight_cache_path`), as without packd
--buffer      compile from the model's bytes (`CompiledModel.from_buffer`)
--ynnpack     ask for YNNPACK (`CpuOptions(enable_ynnpack=True)`)
--start-at    sleep until this time (seconds since the epoch) after the imports, so that
              workers started together compile together; times are counted from the
              moment the worker went on; `stdin`: print {"armed": PID} and read the time
              from standard input (examples/together.py)
--hold        after printing, wait until standard input closes (to measure memory)

The line has: `output_sha256` and `output` (hex) of the first inference, `ready_s` (compile
and first inference, from `start`: the moment the worker went on after --start-at or the
imports), `compile_s`, the worker's `pid`, `packd` (`packd.litert.status()`, or null), and
on a failed compile `error`.
"""

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import together  # noqa: E402  (examples/together.py: the start gate of the benchmarks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--packd", action="store_true")
    p.add_argument("--own-cache", default="")
    p.add_argument("--buffer", action="store_true")
    p.add_argument("--ynnpack", action="store_true")
    p.add_argument("--start-at")
    p.add_argument("--hold", action="store_true")
    a = p.parse_args()

    import numpy as np

    if a.packd:
        import packd.litert

        packd.litert.enable()
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.options import CpuOptions, Options

    t0 = together.wait(a.start_at)
    options = Options(cpu_options=CpuOptions(num_threads=1, enable_ynnpack=a.ynnpack,
                                             xnnpack_weight_cache_path=a.own_cache))
    out = {"pid": os.getpid(), "start": t0}
    try:
        if a.buffer:
            with open(a.model, "rb") as f:
                model = CompiledModel.from_buffer(f.read(), options=options)
        else:
            model = CompiledModel.from_file(a.model, options=options)
    except RuntimeError as e:
        out["error"] = str(e)
        out["packd"] = packd.litert.status() if a.packd else None
        print(json.dumps(out), flush=True)
        return
    t1 = time.time()
    inputs = model.create_input_buffers(0)
    outputs = model.create_output_buffers(0)
    detail = model.get_input_tensor_details("serving_default")["input"]
    dtype = np.dtype(detail["dtype"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal(detail["shape"])
    x = np.clip(np.round(x * 20), -128, 127).astype(dtype) if dtype == np.int8 else x.astype(dtype)
    inputs[0].write(x)
    model.run_by_index(0, inputs, outputs)
    n = int(np.prod(model.get_output_tensor_details("serving_default")["output"]["shape"]))
    y = outputs[0].read(n, dtype)
    t2 = time.time()
    out.update(
        output=y.tobytes().hex(),
        output_sha256=hashlib.sha256(y.tobytes()).hexdigest(),
        ready_s=t2 - t0,
        compile_s=t1 - t0,
        packd=packd.litert.status() if a.packd else None,
    )
    print(json.dumps(out), flush=True)
    if a.hold:
        sys.stdin.read()


if __name__ == "__main__":
    main()
