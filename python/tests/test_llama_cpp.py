"""llama-cpp-python as its users run it, over llama.cpp libraries built once (LLAMA_CPP_LIB_PATH,
the package's supported way to use an existing libllama), with packd turned on by one line,
`packd.llama.enable()`, against the real daemon: the first worker repacks and publishes,
later ones (enable before or after `import llama_cpp`, or the library loaded with ctypes
before it) repack nothing and compute bit-identical logits; four at once build once.

Needs llama_cpp importable with LLAMA_CPP_LIB_PATH set (.ci/run installs the package of each
supported version without its own build, over the libraries examples/llama/fetch-llama
built), PACKD_LLAMA_MODEL (examples/llama/make-model.py) and libpackd_llama.so
(PACKD_LLAMA_LIB, else target/debug).
"""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import _binary

WORKER = r"""
import ctypes, hashlib, json, os, sys
how = sys.argv[1]
if how == "ctypes-first":
    ctypes.CDLL(os.environ["PACKD_LLAMA_LIB"])        # no enable() call
if how == "enable-first":
    import packd.llama
    packd.llama.enable()
import llama_cpp
from llama_cpp import Llama
if how == "import-first":
    import packd.llama
    packd.llama.enable()
llm = Llama(model_path=os.environ["PACKD_LLAMA_MODEL"], n_ctx=256, n_threads=1, verbose=False, seed=1)
llm.eval(llm.tokenize(b"w1 w2 w3 w4", add_bos=True))
n = llama_cpp.llama_n_vocab(llama_cpp.llama_model_get_vocab(llm.model))
p = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
logits = bytes((ctypes.c_float * n).from_address(ctypes.addressof(p.contents)))
out = {"logits": hashlib.sha256(logits).hexdigest(), "version": llama_cpp.__version__}
if how != "plain":
    import time
    import packd.llama
    # A builder's publication finishes on a thread of its own: wait until every buffer has
    # its outcome (served, published or private).
    deadline = time.time() + 60
    while True:
        s = packd.llama.status()
        if s.get("buffers", 0) == s.get("served", 0) + s.get("built", 0) + s.get("private", 0) or time.time() > deadline:
            break
        time.sleep(0.05)
    out["status"] = s
print(json.dumps(out))
"""


def _need():
    if not os.environ.get("LLAMA_CPP_LIB_PATH"):
        pytest.skip("LLAMA_CPP_LIB_PATH is not set: run .ci/run, or point it at a fetch-llama root's lib")
    model = os.environ.get("PACKD_LLAMA_MODEL")
    if not model or not os.path.exists(model):
        pytest.skip("PACKD_LLAMA_MODEL is not a file: run .ci/run, or write one with examples/llama/make-model.py")
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, RuntimeError, OSError) as e:
        pytest.skip(f"llama_cpp does not import: {e}")


@pytest.fixture
def env(daemon):
    _need()
    return dict(os.environ, PACKD_SOCKET_DIR=str(daemon.dir),
                PACKD_LLAMA_LIB=str(_binary("PACKD_LLAMA_LIB", "libpackd_llama.so")),
                PACKD_NAMES=str(daemon.dir / "names"))


def _start(env, how):
    return subprocess.Popen([sys.executable, "-c", WORKER, how], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _run(env, how):
    return _finish(_start(env, how))


def _expected_types():
    """What CPU_REPACK takes from the test model on this CPU (tests/tests/llama.rs says why)."""
    types = {"q4_0": 13, "iq4_nl": 4, "q4_K": 4, "mxfp4": 2}
    flags = open("/proc/cpuinfo").read()
    if os.uname().machine == "x86_64" and " avx512f" in flags:
        types["q2_K"] = 1
    if os.uname().machine == "aarch64":
        types.update({"q8_0": 3, "q5_K": 1, "q6_K": 1})
    return types


def _built(s):
    assert (s["buffers"], s["built"], s["served"], s["private"]) == (1, 1, 0, 0), s
    assert s["published"] == 1, s  # the old name of "built", kept until 0.3
    assert s["tensors_repacked"] == sum(_expected_types().values()) and s["types"] == _expected_types(), s


def _served(s):
    assert (s["buffers"], s["served"], s["built"], s["private"]) == (1, 1, 0, 0), s
    assert (s["tensors_repacked"], s["tensors_served"]) == (0, sum(_expected_types().values())), s
    assert s["types"] == _expected_types() and s["bytes_shared"] > 0, s


def test_enable_before_or_after_import_or_ctypes_first_shares_with_identical_logits(env, daemon):
    plain = _run(env, "plain")
    first = _run(env, "enable-first")
    assert first["logits"] == plain["logits"]
    _built(first["status"])
    assert first["status"]["library"] == env["PACKD_LLAMA_LIB"]
    deadline = time.time() + 30
    while daemon.stats()["publishes"] != 1:
        assert time.time() < deadline, daemon.stats()
        time.sleep(0.1)
    for how in ("enable-first", "import-first", "ctypes-first"):
        r = _run(env, how)
        assert r["logits"] == plain["logits"], how
        _served(r["status"])
        assert r["status"]["ggml_version"] and r["status"]["unsupported"] is None, r["status"]
    stats = daemon.stats()
    assert (stats["builds"], stats["publishes"], stats["private_reports"]) == (1, 1, 0), stats


def test_four_workers_at_once_build_once(env, daemon, tmp_path):
    plain = _run(env, "plain")
    # The builder holds after its first tensor until the three others wait for it: they
    # overlap for certain, however the machine schedules them.
    go = tmp_path / "go"
    held = dict(env, PACKD_LLAMA_HOLD_BUILD=str(go))
    procs = [_start(held, how) for how in ("enable-first", "import-first", "enable-first", "ctypes-first")]
    deadline = time.time() + 300
    while daemon.stats().get("build_waits", 0) < 3 and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.1)
    waits = daemon.stats().get("build_waits", 0)
    go.write_text("")
    runs = [_finish(p) for p in procs]
    assert waits >= 3, ("three workers never waited for the builder", daemon.stats())
    assert all(r["logits"] == plain["logits"] for r in runs)
    built = [r for r in runs if r["status"]["built"]]
    assert len(built) == 1, [r["status"] for r in runs]
    _built(built[0]["status"])
    for r in runs:
        if not r["status"]["built"]:
            _served(r["status"])
    stats = daemon.stats()
    assert (stats["builds"], stats["publishes"]) == (1, 1), stats


def test_without_the_library_enable_fails_loudly_and_llama_cpp_runs_untouched(env, tmp_path):
    env = dict(env, PACKD_LLAMA_LIB=str(tmp_path / "nowhere" / "libpackd_llama.so"))
    code = ("import packd.llama\n"
            "try:\n    packd.llama.enable()\nexcept FileNotFoundError as e:\n    print(e)\n"
            "print(packd.llama.status())\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "no libpackd_llama.so (looked at " + env["PACKD_LLAMA_LIB"] in out, out
    assert "PACKD_LLAMA_LIB" in out and "{'enabled': False, 'library': None}" in out, out
