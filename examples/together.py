"""Starting workers together, for the benchmarks: every worker imports its engine first, says
so, and waits; when all have said so, the harness gives each the same start time.

A fixed start time chosen before the workers are spawned (`--start-at EPOCH`) is missed when
their imports take longer than the margin (importing torch takes seconds of CPU, and N
workers import on the same cores): the late ones then load beside the others' imports, and
the figures measure the imports. The gate waits for the imports instead.

In a worker:   start = together.wait(a.start_at)   # after the imports; returns the epoch time
               it started at (None, EPOCH or "stdin" as given), and writes {"armed": PID} first
               when the start time is to come from standard input.
In a harness:  together.start(procs)                # procs spawned with --start-at stdin and
               stdin/stdout pipes in text mode; returns the start time given.
"""

from __future__ import annotations

import json
import os
import sys
import time

# How far ahead of the last worker's "armed" the start is put: time to write N lines.
MARGIN_S = 0.05


def wait(start_at: str | None) -> float:
    """Waits until the start time (given, or read from standard input after saying "armed");
    returns the moment the worker went on (now, without a start time)."""
    if not start_at:
        return time.time()
    if start_at == "stdin":
        print(json.dumps({"armed": os.getpid()}), flush=True)
        line = sys.stdin.readline()
        if not line:
            sys.exit("no start time on standard input")
        start_at = line
    time.sleep(max(0.0, float(start_at) - time.time()))
    return time.time()


def start(procs, margin_s: float = MARGIN_S) -> float:
    """Reads every worker's "armed" line, then gives all of them one start time."""
    for p in procs:
        line = p.stdout.readline()
        if not line or "armed" not in json.loads(line):
            raise RuntimeError(f"worker {p.pid} did not arm: {line!r}")
    at = time.time() + margin_s
    for p in procs:
        p.stdin.write(f"{at}\n")
        p.stdin.flush()
    return at
