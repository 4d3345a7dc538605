"""ONNX Runtime workers (onnxruntime from PyPI, unmodified) sharing a model's optimized form,
its weights and MLAS's prepacked weights through packd (packd.onnxruntime.enable()): ordinary
ONNX models written at test time (examples/onnxruntime/make-model.py: all-MiniLM-L6-v2 with its
weights inside the model and as external data, a convolutional net, an MLP), real worker
processes (examples/onnxruntime/worker.py), a real daemon.

Needs onnxruntime and onnx (`pip install './python[onnxruntime]'`) and, for MiniLM,
PACKD_TEST_MODEL_DIR (.ci/run fetches it); skipped with the reason when not (CI fails on a skip).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from conftest import Daemon, change_during_build

pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install './python[onnxruntime]')")
pytest.importorskip("onnx", reason="onnx is not installed (pip install './python[onnxruntime]')")

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "onnxruntime"
MODEL_DIR = os.environ.get("PACKD_TEST_MODEL_DIR")
needs_minilm = pytest.mark.skipif(not MODEL_DIR, reason="PACKD_TEST_MODEL_DIR (MiniLM's model.safetensors) is not set")


def make(out, kind, *args):
    subprocess.run([sys.executable, str(EXAMPLES / "make-model.py"), str(out), kind, *args], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    out = {"conv": make(d / "conv.onnx", "conv"), "conv-bump": make(d / "conv-bump.onnx", "conv", "--bump"),
           "mlp": make(d / "mlp.onnx", "mlp", "--width", "512", "--layers", "3")}
    if MODEL_DIR:
        out["minilm"] = make(d / "minilm.onnx", "minilm", MODEL_DIR)
        (d / "ext").mkdir()
        out["minilm-external"] = make(d / "ext" / "minilm.onnx", "minilm", MODEL_DIR, "--external")
    return out


def start(model, daemon=None, args=(), env=None, packd=True):
    e = dict(os.environ)
    e["PACKD_SOCKET_DIR"] = str(daemon.dir) if daemon is not None else "/nonexistent/packd"
    if daemon is not None:
        # The names memo of this test's daemon, not the user's.
        e["PACKD_NAMES"] = str(pathlib.Path(daemon.dir) / "names")
    e.update(env or {})
    cmd = [sys.executable, str(EXAMPLES / "worker.py"), str(model), *args] + (["--packd"] if packd else [])
    return subprocess.Popen(cmd, env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def line_of(proc):
    """The worker's JSON line, read while it may still hold (--hold)."""
    out = proc.stdout.readline()
    if not out:
        _, err = proc.communicate(timeout=120)
        pytest.fail(f"worker failed ({proc.returncode}): {err[-3000:]}")
    line = json.loads(out)
    assert "error" not in line, line
    return line


def finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}): {out}{err[-3000:]}"
    line = json.loads(out.strip().splitlines()[-1])
    assert "error" not in line, line
    return line, err


def run(model, daemon=None, args=(), env=None, packd=True):
    return finish(start(model, daemon, args, env, packd))


_ALONE = {}


def alone(model):
    """ONNX Runtime alone, pre-packing on (its default): the reference."""
    if model not in _ALONE:
        _ALONE[model] = run(model, packd=False)[0]
    return _ALONE[model]


def counts(line):
    p = line["packd"]
    return p["built"], p["served"], p["private"]


@pytest.mark.parametrize("kind", [
    pytest.param("minilm", marks=needs_minilm),
    pytest.param("minilm-external", marks=needs_minilm),
    "conv",
])
def test_four_workers_at_once_build_once_map_one_copy_and_match_onnx_runtime_alone(models, daemon, kind):
    model = models[kind]
    reference = alone(model)
    procs = [start(model, daemon, ["--hold"]) for _ in range(4)]
    try:
        lines = [line_of(p) for p in procs]
        assert sorted(counts(x) for x in lines) == [(0, 1, 0)] * 3 + [(1, 0, 0)], [x["packd"] for x in lines]
        assert {x["output_sha256"] for x in lines} == {reference["output_sha256"]}
        # Every worker maps the one memfd (the builder its own build, sealed and published).
        memfds = {tuple(x["memfd"]) for x in lines}
        assert len(memfds) == 1 and len(next(iter(memfds))) == 1, memfds
        assert len({x["packd"]["identity"] for x in lines}) == 1
        if kind == "minilm":
            # ONNX Runtime alone holds the weights (90 MB) and their prepacks privately; a
            # served worker holds neither.
            size = model.stat().st_size // 1024
            for x in lines:
                assert x["rss_anon_kib"] < reference["rss_anon_kib"] - 0.9 * size, (x["rss_anon_kib"], reference)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)
    # A later worker is served too.
    later, _ = run(model, daemon)
    assert counts(later) == (0, 1, 0) and later["output_sha256"] == reference["output_sha256"]


@needs_minilm
def test_a_model_from_bytes_is_served_the_copy_its_path_built(models, daemon):
    model = models["minilm"]
    built, _ = run(model, daemon)
    served, _ = run(model, daemon, ["--bytes"])
    assert counts(built) == (1, 0, 0) and counts(served) == (0, 1, 0)
    assert served["output_sha256"] == built["output_sha256"] == alone(model)["output_sha256"]
    assert served["packd"]["identity"] == built["packd"]["identity"]


def test_sessions_of_one_model_created_at_once_in_one_process_are_each_served(models, daemon):
    built, _ = run(models["conv"], daemon)
    line, _ = run(models["conv"], daemon, ["--sessions", "3"])
    assert counts(built) == (1, 0, 0) and counts(line) == (0, 3, 0), line["packd"]
    assert line["outputs_sha256"] == [alone(models["conv"])["output_sha256"]] * 3
    assert len(line["memfd"]) == 1


def test_waiters_are_served_the_builders_copy_before_packd_has_hashed_it(models, tmp_path, monkeypatch):
    # A debug daemon holds every hash for a minute (a test fault): the waiters must be served
    # inside that window, and nothing is in the cache directory until the hash is done.
    monkeypatch.setenv("PACKD_TEST_HASH_DELAY_MS", "60000")
    cache = tmp_path / "cache"
    cache.mkdir()
    d = Daemon(tmp_path, cache_dir=cache)
    procs = []
    try:
        builder = start(models["conv"], d, ["--hold"])
        procs.append(builder)
        deadline = time.time() + 60
        while d.stats().get("builds", 0) < 1:
            assert time.time() < deadline, "the builder never took its role"
            time.sleep(0.05)
        waiters = [start(models["conv"], d, ["--hold"]) for _ in range(3)]
        procs += waiters
        lines = [line_of(p) for p in waiters]
        assert [counts(x) for x in lines] == [(0, 1, 0)] * 3, [x["packd"] for x in lines]
        assert {x["output_sha256"] for x in lines} == {alone(models["conv"])["output_sha256"]}
        assert len({tuple(x["memfd"]) for x in lines}) == 1
        # Published (the builder's copy is what they map), and still unhashed: not persisted.
        assert d.stats()["publishes"] == 1
        assert not list(cache.glob("*.pack")), "nothing is persisted before it is hashed"
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=60)
        d.stop()


def test_a_model_changed_by_one_weight_is_built_again(models, daemon):
    first, _ = run(models["conv"], daemon)
    changed, _ = run(models["conv-bump"], daemon)
    assert counts(first) == (1, 0, 0) and counts(changed) == (1, 0, 0)
    assert changed["packd"]["identity"] != first["packd"]["identity"]
    assert changed["output_sha256"] == alone(models["conv-bump"])["output_sha256"] != first["output_sha256"]


def test_options_that_change_prepacking_name_another_copy(models, daemon):
    packed, _ = run(models["mlp"], daemon)
    unpacked, _ = run(models["mlp"], daemon, ["--no-prepacking"])
    again, _ = run(models["mlp"], daemon, ["--no-prepacking"])
    assert [counts(x) for x in (packed, unpacked, again)] == [(1, 0, 0), (1, 0, 0), (0, 1, 0)]
    assert packed["packd"]["identity"] != unpacked["packd"]["identity"]
    assert again["output_sha256"] == run(models["mlp"], args=["--no-prepacking"], packd=False)[0]["output_sha256"]


def test_with_packd_away_onnx_runtime_runs_alone_and_says_why(models):
    line, err = run(models["conv"])
    assert counts(line) == (0, 0, 1)
    assert line["packd"]["fallbacks"] == {"daemon_away": 1}
    assert line["output_sha256"] == alone(models["conv"])["output_sha256"]
    assert "packd-onnxruntime: ONNX Runtime creates the session without packd: packd is away" in err


def test_the_builder_killed_while_it_holds_its_role_hands_it_on(models, daemon, tmp_path):
    release = tmp_path / "never"
    builder = start(models["conv"], daemon, env={"PACKD_ONNXRUNTIME_HOLD_BUILD": str(release)})
    deadline = time.time() + 60
    while daemon.stats().get("builds_active", 0) < 1:
        assert time.time() < deadline, "the builder never took its role"
        time.sleep(0.05)
    waiter = start(models["conv"], daemon)
    time.sleep(0.5)
    builder.send_signal(signal.SIGKILL)
    builder.wait(timeout=30)
    line, _ = finish(waiter)
    assert counts(line) == (1, 0, 0)
    assert line["output_sha256"] == alone(models["conv"])["output_sha256"]


@pytest.mark.parametrize("case,reason", [
    ("provider", "another execution provider (AzureExecutionProvider)"),
    ("ort-format", "an ORT-format model (packd shares ONNX models)"),
    ("off", "PACKD_ONNXRUNTIME=off"),
])
def test_what_packd_leaves_alone_runs_as_onnx_runtime_alone_with_its_reason(models, daemon, tmp_path, case, reason):
    model, args, env = models["conv"], [], {}
    if case == "provider":
        args = ["--providers", "AzureExecutionProvider,CPUExecutionProvider"]
    elif case == "ort-format":
        import onnxruntime as ort

        model = tmp_path / "conv.ort"
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(model)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        ort.InferenceSession(str(models["conv"]), options, providers=["CPUExecutionProvider"])
    else:
        env = {"PACKD_ONNXRUNTIME": "off"}
    line, err = run(model, daemon, args, env)
    assert counts(line) == (0, 0, 1)
    assert line["packd"]["reasons"] == {reason: 1}
    assert reason in err
    assert line["output_sha256"] == alone(models["conv"])["output_sha256"] or case == "ort-format"
    assert line["memfd"] == []


@pytest.fixture(scope="module")
def c_worker(tmp_path_factory):
    """examples/onnxruntime/worker.c built against ONNX Runtime's C API headers
    (PACKD_ORT_INCLUDE, which examples/onnxruntime/fetch-ort-headers prints), the onnxruntime
    wheel's libonnxruntime.so and libpackd_onnxruntime.so (built here)."""
    include = os.environ.get("PACKD_ORT_INCLUDE")
    if not include or not (pathlib.Path(include) / "onnxruntime_c_api.h").exists():
        pytest.skip("PACKD_ORT_INCLUDE (ONNX Runtime's C headers: examples/onnxruntime/fetch-ort-headers) is not set")
    import onnxruntime as ort

    wheel_lib = next((pathlib.Path(ort.__file__).parent / "capi").glob("libonnxruntime.so.*"))
    d = tmp_path_factory.mktemp("cworker")
    # The wheel names its library by version; its soname is libonnxruntime.so.1.
    (d / "libonnxruntime.so.1").symlink_to(wheel_lib)
    (d / "libonnxruntime.so").symlink_to("libonnxruntime.so.1")
    subprocess.run(["cargo", "build", "-q", "-p", "packd-onnxruntime-c"], cwd=ROOT, check=True)
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target") / "debug"
    out = d / "worker"
    subprocess.run(["cc", "-O2", "-Wall", "-Werror", str(EXAMPLES / "worker.c"), f"-I{include}",
                    f"-I{ROOT / 'onnxruntime' / 'c' / 'include'}", f"-L{d}", "-lonnxruntime", f"-L{target}",
                    "-lpackd_onnxruntime", "-lm", f"-Wl,-rpath,{d}:{target}", "-o", str(out)], check=True)
    return out


def c_start(worker, model, daemon=None, args=(), packd=True):
    e = dict(os.environ, PACKD_SOCKET_DIR=str(daemon.dir) if daemon is not None else "/nonexistent/packd")
    return subprocess.Popen([str(worker), str(model), *args, *(["--packd"] if packd else [])], env=e,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("kind", ["conv", "mlp"])
def test_c_workers_at_once_build_once_and_map_one_copy(models, daemon, c_worker, kind):
    reference, _ = finish(c_start(c_worker, models[kind], packd=False))
    procs = [c_start(c_worker, models[kind], daemon, ["--hold"]) for _ in range(3)]
    try:
        lines = [line_of(p) for p in procs]
        assert sorted(counts(x) for x in lines) == [(0, 1, 0)] * 2 + [(1, 0, 0)], [x["packd"] for x in lines]
        assert {x["output_fnv"] for x in lines} == {reference["output_fnv"]}
        assert len({x["memfd"] for x in lines}) == 1 and lines[0]["memfd"]
        assert lines[0]["packd"]["engine"].startswith("libonnxruntime.so")
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=60)


def test_a_c_worker_with_packd_away_runs_alone_and_says_why(models, c_worker):
    reference, _ = finish(c_start(c_worker, models["conv"], packd=False))
    line, err = finish(c_start(c_worker, models["conv"]))
    assert counts(line) == (0, 0, 1) and line["packd"]["fallbacks"] == {"daemon_away": 1}
    assert line["output_fnv"] == reference["output_fnv"] and line["memfd"] == ""
    assert "packd is away" in err


def test_a_model_changed_while_it_is_built_is_never_served(models, daemon, tmp_path):
    """The first worker builds under the model file's provisional name while packd finds its
    digest; a model file written meanwhile (here: its times) is never served: the builder
    creates its session as ONNX Runtime alone would and gives its role up, and the next
    worker builds anew."""
    model = tmp_path / "m.onnx"
    model.write_bytes(models["conv"].read_bytes())
    reference = alone(model)
    go = tmp_path / "go"
    before = daemon.stats()
    builder = start(model, daemon, env={"PACKD_ONNXRUNTIME_HOLD_BUILD": str(go)})
    line = change_during_build(daemon, before, builder, model, go)
    assert line["output_sha256"] == reference["output_sha256"]
    again, _ = run(model, daemon)
    assert counts(again) == (1, 0, 0) and again["output_sha256"] == reference["output_sha256"], again["packd"]
    later, _ = run(model, daemon)
    assert counts(later) == (0, 1, 0) and later["output_sha256"] == reference["output_sha256"], later["packd"]
