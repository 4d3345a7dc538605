"""LiteRT workers (ai-edge-litert 2.3.0 from PyPI, unmodified) sharing XNNPACK's packed weights
through packd (packd.litert.enable()): real .tflite models written at test time
(examples/litert/make-model.py: CONV_2D, DEPTHWISE_CONV_2D and FULLY_CONNECTED, f32 and int8),
real worker processes (examples/litert/worker.py), a real daemon.

Needs ai-edge-litert (`.ci/run` installs it in a venv of its own). Without it the tests are
skipped with the reason, unless PACKD_REQUIRE_LITERT=1 (as in CI), where a missing LiteRT
fails them.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import Daemon, change_during_build, wait_for_stat

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "litert"

try:
    import ai_edge_litert.compiled_model  # noqa: F401

    HAVE = True
except ImportError as e:  # pragma: no cover - depends on the environment
    HAVE = False
    if os.environ.get("PACKD_REQUIRE_LITERT") == "1":
        raise
    pytestmark = pytest.mark.skip(reason=f"LiteRT is not installed ({e}): pip install ai-edge-litert==2.3.0")

# Big enough that XNNPACK packs for a while (four 1 MiB hidden layers), small enough for CI.
SHAPE = ["--width", "512", "--layers", "4"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("tflite")
    for name, args in [("f32", []), ("int8", ["--dtype", "int8"]), ("f32-bump", ["--bump"])]:
        subprocess.run([sys.executable, str(EXAMPLES / "make-model.py"), str(out / f"{name}.tflite"), *SHAPE, *args],
                       check=True, capture_output=True)
    return out


def start(model, daemon=None, args=(), env=None):
    e = dict(os.environ)
    if daemon is not None:
        e["PACKD_SOCKET_DIR"] = str(daemon.dir)
        # The names memo of this test's daemon, not the user's.
        e["PACKD_NAMES"] = str(pathlib.Path(daemon.dir) / "names")
    e.update(env or {})
    return subprocess.Popen([sys.executable, str(EXAMPLES / "worker.py"), str(model), *args], env=e,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def line_of(proc):
    """The worker's JSON line, read while it may still hold (--hold)."""
    out = proc.stdout.readline()
    if not out:
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"worker failed ({proc.returncode}): {err[-3000:]}")
    return json.loads(out)


def finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}): {out}{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1]), err


def run(model, daemon=None, args=(), env=None):
    return finish(start(model, daemon, args, env))[0]


def references(model, tmp):
    """LiteRT alone: without a cache, and with its own cache file (built, then loaded)."""
    plain = run(model)
    own = tmp / f"{model.stem}.xnnpack_cache"
    built = run(model, args=["--own-cache", str(own)])
    loaded = run(model, args=["--own-cache", str(own)])
    assert own.stat().st_size > 0
    for r in (built, loaded):
        assert r["output_sha256"] == plain["output_sha256"], (r, plain)
    return plain


def cache_inodes(pid):
    """The memfds named packd-litert-cache that process `pid` maps: (device, inode) -> bytes."""
    found = {}
    for line in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines():
        f = line.split()
        if len(f) >= 6 and "memfd:packd-litert-cache" in line:
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            found[(f[3], f[4])] = found.get((f[3], f[4]), 0) + hi - lo
    return found


@pytest.mark.parametrize("kind", ["f32", "int8"])
def test_four_workers_at_once_build_once_and_the_others_map_the_same_pages(models, daemon, tmp_path, kind):
    model = models / f"{kind}.tflite"
    reference = references(model, tmp_path)
    go = pathlib.Path(tempfile.mkdtemp(prefix="packd-go-")) / "go"
    before = daemon.stats()
    procs = [start(model, daemon, ["--packd", "--hold"], {"PACKD_LITERT_HOLD_BUILD": str(go)}) for _ in range(4)]
    try:
        # The builder holds its build until the three others wait for it: they cannot simply
        # come after its publication.
        deadline = time.time() + 120
        while daemon.stats().get("build_waits", 0) - before.get("build_waits", 0) < 3:
            assert time.time() < deadline and all(p.poll() is None for p in procs), "the others never waited"
            time.sleep(0.05)
        go.touch()
        lines = [line_of(p) for p in procs]
        for line in lines:
            assert line["output_sha256"] == reference["output_sha256"], (line, reference)
            assert line["packd"]["private"] == 0 and not line["packd"]["reasons"], line
        built = [x for x in lines if x["packd"]["built"] == 1]
        served = [x for x in lines if x["packd"]["served"] == 1]
        assert len(built) == 1 and len(served) == 3, [x["packd"] for x in lines]
        size = built[0]["packd"]["bytes_shared"]
        assert size > 4 << 20 if kind == "f32" else size > 1 << 20, size
        assert all(x["packd"]["bytes_shared"] == size for x in served)
        # One copy: the four map the very same memfd, its whole size.
        inodes = [cache_inodes(p.pid) for p in procs]
        assert all(len(i) == 1 for i in inodes) and len({k for i in inodes for k in i}) == 1, inodes
        assert all(v == size for i in inodes for v in i.values()), (inodes, size)
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=60)
    stats = daemon.stats()
    assert stats["builds"] - before.get("builds", 0) == 1, stats
    assert stats["publishes"] - before.get("publishes", 0) == 1, stats
    assert stats.get("builds_given_up", 0) == before.get("builds_given_up", 0), stats
    # A later worker is served, and so is a worker that compiles from the model's bytes.
    for args in (["--packd"], ["--packd", "--buffer"]):
        later = run(model, daemon, args)
        assert later["output_sha256"] == reference["output_sha256"]
        assert later["packd"]["served"] == 1 and later["packd"]["bytes_shared"] == size, later


def test_a_model_changed_by_one_weight_never_hits_the_old_cache(models, daemon):
    old, new = models / "f32.tflite", models / "f32-bump.tflite"
    reference = run(new)
    assert reference["output_sha256"] != run(old)["output_sha256"]
    first = run(old, daemon, ["--packd"])
    assert first["packd"]["built"] == 1 and first["packd"]["served"] == 0, first  # a fresh daemon
    changed = run(new, daemon, ["--packd"])
    assert changed["packd"]["built"] == 1 and changed["packd"]["served"] == 0, changed
    assert changed["packd"]["identity"] != first["packd"]["identity"]
    assert changed["output_sha256"] == reference["output_sha256"]


def test_with_packd_away_the_worker_runs_as_litert_alone_and_says_why(models, tmp_path):
    model = models / "int8.tflite"
    reference = run(model)
    line, err = finish(start(model, args=["--packd"], env={"PACKD_SOCKET_DIR": str(tmp_path / "nowhere")}))
    assert line["output_sha256"] == reference["output_sha256"]
    s = line["packd"]
    assert (s["served"], s["built"], s["private"]) == (0, 0, 1), s
    assert s["fallbacks"] == {"daemon_away": 1}, s
    assert "packd-litert: LiteRT compiles without packd's weight cache: packd is away" in err


def test_a_builder_killed_mid_build_hands_the_role_on(models, daemon):
    # A model of its own, so that no earlier test published it.
    fresh = models / "f32-seed7.tflite"
    subprocess.run([sys.executable, str(EXAMPLES / "make-model.py"), str(fresh), *SHAPE, "--seed", "7"], check=True)
    reference = run(fresh)
    before = daemon.stats()
    never = pathlib.Path(tempfile.mkdtemp(prefix="packd-never-")) / "never"
    builder = start(fresh, daemon, ["--packd"], {"PACKD_LITERT_HOLD_BUILD": str(never)})
    deadline = time.time() + 120
    while daemon.stats().get("builds_active", 0) < 1:
        assert time.time() < deadline and builder.poll() is None, "the first worker never became the builder"
        time.sleep(0.05)
    waiter = start(fresh, daemon, ["--packd"])
    while daemon.stats().get("build_waits", 0) - before.get("build_waits", 0) < 1:
        assert time.time() < deadline and waiter.poll() is None, "the second worker never waited"
        time.sleep(0.05)
    builder.send_signal(signal.SIGKILL)
    builder.communicate(timeout=60)
    line, _ = finish(waiter)
    assert line["output_sha256"] == reference["output_sha256"]
    assert line["packd"]["built"] == 1 and line["packd"]["private"] == 0, line
    stats = daemon.stats()
    assert stats["builds_abandoned"] - before.get("builds_abandoned", 0) == 1, stats
    assert stats["publishes"] - before.get("publishes", 0) == 1, stats
    later = run(fresh, daemon, ["--packd"])
    assert later["packd"]["served"] == 1 and later["output_sha256"] == reference["output_sha256"], later


def test_a_worker_with_its_own_cache_file_is_left_alone(models, daemon, tmp_path):
    model = models / "f32.tflite"
    reference = run(model)
    own = tmp_path / "own.cache"
    before = daemon.stats()
    proc = start(model, daemon, ["--packd", "--own-cache", str(own), "--hold"])
    line = line_of(proc)
    # While its model lives, the worker is one of packd's private workers.
    held = daemon.stats()
    proc.stdin.close()
    proc.wait(timeout=60)
    assert held["workers_private"] == before.get("workers_private", 0) + 1, held
    assert line["output_sha256"] == reference["output_sha256"]
    s = line["packd"]
    assert (s["served"], s["built"], s["private"]) == (0, 0, 1) and s["fallbacks"] == {"engine_cache": 1}, s
    assert own.stat().st_size > 4 << 20, "LiteRT did not build its own cache file"
    stats = daemon.stats()
    assert stats["private_fallbacks"]["engine_cache"] - before["private_fallbacks"]["engine_cache"] == 1, stats


def test_ynnpack_asked_for_fails_as_without_packd_and_packd_says_why(models, daemon):
    # LiteRT 2.3.0's wheel has no YNNPACK: enable_ynnpack=True fails the compile. With packd
    # on, the same error, and the reason counted.
    model = models / "f32.tflite"
    plain = run(model, args=["--ynnpack"])
    before = daemon.stats()
    line = run(model, daemon, ["--packd", "--ynnpack"])
    assert "error" in plain and line.get("error") == plain["error"], (line, plain)
    s = line["packd"]
    assert s["private"] == 1 and any("YNNPACK" in r for r in s["reasons"]), s
    stats = daemon.stats()
    assert stats["private_fallbacks"]["other"] - before["private_fallbacks"]["other"] == 1, stats
    assert stats["builds"] == before.get("builds", 0), stats


def test_enabled_in_process_litert_keeps_its_signatures(models, daemon, monkeypatch):
    # packd.litert.enable() in this very process: the keyword names LiteRT's own
    # from_file/from_buffer take (model_path, model_data, options, hardware_accel), a
    # PathLike path, a builder then a served compile, outputs as a worker without packd.
    import numpy as np

    import packd.litert
    from ai_edge_litert.compiled_model import CompiledModel
    from ai_edge_litert.hardware_accelerator import HardwareAccelerator

    monkeypatch.setenv("PACKD_SOCKET_DIR", str(daemon.dir))
    fresh = models / "int8-seed11.tflite"
    subprocess.run([sys.executable, str(EXAMPLES / "make-model.py"), str(fresh), *SHAPE, "--dtype", "int8",
                    "--seed", "11"], check=True)
    reference = run(fresh)["output"]
    assert packd.litert.enable()["enabled"]

    def infer(model):
        inputs, outputs = model.create_input_buffers(0), model.create_output_buffers(0)
        rng = np.random.default_rng(0)
        x = np.clip(np.round(rng.standard_normal([1, 8, 8, 8]) * 20), -128, 127).astype(np.int8)
        inputs[0].write(x)
        model.run_by_index(0, inputs, outputs)
        return outputs[0].read(16, np.int8).tobytes().hex()

    built = CompiledModel.from_file(model_path=fresh, hardware_accel=HardwareAccelerator.CPU)
    assert infer(built) == reference
    served = CompiledModel.from_buffer(model_data=fresh.read_bytes())
    assert infer(served) == reference
    s = packd.litert.status()
    assert (s["built"], s["served"], s["private"]) == (1, 1, 0), s
    # The file was built under its provisional name and published under its digest's
    # identity (the provisional one its alias): the bytes, named by their digest, are served.
    assert built._packd_litert.identity != served._packd_litert.identity
    assert s["identity"] == served._packd_litert.identity
    assert daemon.stats()["aliases_filed"] == 1


def test_a_model_changed_while_its_cache_is_built_is_never_served(models, daemon, tmp_path):
    """The first worker builds under the model file's provisional name while packd finds its
    digest; a model file written meanwhile (here: its times) is never served: the builder
    keeps its cache private and gives its role up, and the next worker builds anew."""
    model = tmp_path / "m.tflite"
    model.write_bytes((models / "f32.tflite").read_bytes())
    reference = run(model)
    go = tmp_path / "go"
    before = daemon.stats()
    builder = start(model, daemon, ["--packd"], {"PACKD_LITERT_HOLD_BUILD": str(go)})
    line = change_during_build(daemon, before, builder, model, go)
    assert line["output_sha256"] == reference["output_sha256"]
    # The changed file has another provisional name: built, then served.
    again = run(model, daemon, ["--packd"])
    assert again["packd"]["built"] == 1 and again["output_sha256"] == reference["output_sha256"], again
    later = run(model, daemon, ["--packd"])
    assert later["packd"]["served"] == 1 and later["output_sha256"] == reference["output_sha256"], later


def test_a_publication_whose_hash_fails_is_withdrawn_and_the_next_worker_builds_again(models, tmp_path):
    """Every publication's hash held, then failed (a debug build's test fault): the waiter
    served in the window keeps the builder's bytes; new workers are not served them."""
    d = Daemon(tmp_path, env={"PACKD_TEST_HASH_DELAY_MS": "3000", "PACKD_TEST_HASH_FAIL": "*"})
    try:
        model = models / "f32.tflite"
        reference = run(model)
        go = pathlib.Path(tempfile.mkdtemp(prefix="packd-go-")) / "go"
        procs = [start(model, d, ["--packd", "--hold"], {"PACKD_LITERT_HOLD_BUILD": str(go)}) for _ in range(2)]
        try:
            deadline = time.time() + 120
            while d.stats().get("build_waits", 0) < 1:
                assert time.time() < deadline and all(p.poll() is None for p in procs), "nobody waited"
                time.sleep(0.05)
            go.touch()
            lines = [line_of(p) for p in procs]
            for line in lines:
                assert line["output_sha256"] == reference["output_sha256"], (line, reference)
            assert sorted(x["packd"]["served"] for x in lines) == [0, 1], [x["packd"] for x in lines]
            wait_for_stat(d, "publishes_withdrawn", 1)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.stdin.close()
                    p.wait(timeout=60)
        later = run(model, d, ["--packd"])
        assert later["output_sha256"] == reference["output_sha256"]
        assert later["packd"]["served"] == 0, later
        assert d.stats()["builds"] == 2, d.stats()
    finally:
        d.stop()
