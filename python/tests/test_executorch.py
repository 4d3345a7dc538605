"""ExecuTorch workers, installed from PyPI and unmodified, sharing their packed weights through
packd (packd.executorch.enable()): real .pte files exported at test time, real worker
processes (examples/executorch/worker.py), a real daemon.

Needs torch and executorch (`.ci/run` installs them in a venv of their own). Without them the
tests are skipped with the reason, unless PACKD_REQUIRE_EXECUTORCH=1 (as in CI), where a
missing ExecuTorch fails them.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import Daemon, change_during_build, wait_for_stat

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "executorch"

try:
    import executorch  # noqa: F401
    import torch  # noqa: F401

    HAVE = True
except ImportError as e:  # pragma: no cover - depends on the environment
    HAVE = False
    WHY = f"ExecuTorch is not installed ({e}): pip install torch==2.15.0 executorch==1.5.1"
    if os.environ.get("PACKD_REQUIRE_EXECUTORCH") == "1":
        raise
    pytestmark = pytest.mark.skip(reason=WHY)


@pytest.fixture(scope="module")
def ptes(tmp_path_factory):
    out = tmp_path_factory.mktemp("pte")
    subprocess.run([sys.executable, str(EXAMPLES / "export.py"), str(out)], check=True, capture_output=True)
    subprocess.run([sys.executable, str(EXAMPLES / "export.py"), str(out), "--model", "mlp", "--tweak"],
                   check=True, capture_output=True)
    return out


def run(pte, daemon=None, packd=False, start_at=None, extra_env=None, wait=True, hold=0, settle=False):
    """Runs (or starts, with wait=False) one worker; returns its JSON line (or the process).
    With hold, the worker stays alive that many seconds after its line; with settle, its
    status is read once its publication ended."""
    env = dict(os.environ)
    if daemon is not None:
        env["PACKD_SOCKET_DIR"] = str(daemon.dir)
        # The names memo of this test's daemon, not the user's.
        env["PACKD_NAMES"] = str(pathlib.Path(daemon.dir) / "names")
    env.update(extra_env or {})
    cmd = [sys.executable, str(EXAMPLES / "worker.py"), str(pte)]
    if packd:
        cmd.append("--packd")
    if start_at:
        cmd += ["--start-at", str(start_at)]
    if hold:
        cmd += ["--hold", str(hold)]
    if settle:
        cmd.append("--settle")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return finish(proc) if wait else proc


def finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}): {out}{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def first_line(proc):
    """The JSON line of a worker that stays alive after it."""
    line = proc.stdout.readline()
    assert line, f"worker failed ({proc.poll()}): {proc.stderr.read()[-3000:]}"
    return json.loads(line)


def xnnpack_memfds(pid):
    """The packd XNNPACK memfds process `pid` maps, as (device, inode) pairs."""
    with open(f"/proc/{pid}/maps") as f:
        return {tuple(line.split()[3:5]) for line in f if "/memfd:packd-xnnpack" in line}


def at_once(pte, daemon, n=4, keep=None):
    """Starts n workers together; the one that builds holds its build until the n - 1 others
    wait for it (PACKD_XNNPACK_HOLD_BUILD names a file created then), so they cannot simply
    come after it. Returns their JSON lines and the daemon's build_waits when released. With
    a list `keep`, the workers stay alive after their lines and are appended to it."""
    go = pathlib.Path(tempfile.mkdtemp(prefix="packd-go-")) / "go"
    before = daemon.stats().get("build_waits", 0)
    procs = [run(pte, daemon, packd=True, wait=False, extra_env={"PACKD_XNNPACK_HOLD_BUILD": str(go)},
                 hold=120 if keep is not None else 0)
             for _ in range(n)]
    deadline = time.time() + 300
    waits = 0
    while waits < n - 1 and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.1)
        waits = daemon.stats().get("build_waits", 0) - before
    go.touch()
    if keep is not None:
        keep.extend(procs)
        return [first_line(p) for p in procs], waits
    return [finish(p) for p in procs], waits


@pytest.mark.parametrize("model", ["mlp", "convnet", "qlinear", "twomethods"])
def test_workers_started_at_once_build_once_and_the_others_pack_nothing(ptes, daemon, model):
    pte = ptes / f"{model}.pte"
    reference = run(pte)  # ExecuTorch as it ships: no weights cache, every worker packs
    lines, waits = at_once(pte, daemon)
    # The others waited for the one build (the builder held it until they did).
    assert waits >= 3, f"only {waits} of the 3 other workers waited for the builder"
    for line in lines:
        assert line["output_sha256"] == reference["output_sha256"], (model, line)
        s = line["packd"]
        assert s["interface"] == 202603 and s["engine"].endswith("libexecutorch_backend_xnnpack.so"), s
        assert s["private"] == 0 and not s["reasons"], s
    status = [line["packd"] for line in lines]
    runtimes = status[0]["runtimes"]
    assert runtimes >= 1 and all(s["runtimes"] == runtimes for s in status), status
    builders = [s for s in status if s["built"] > 0]
    served = [s for s in status if s["served"] == runtimes]
    assert len(builders) == 1 and len(served) == 3, status
    for s in served:
        # Every weight XNNPACK looked up was served: nothing packed in this process.
        assert s["misses"] == 0 and s["reserve_space"] == 0 and s["bytes_packed"] == 0, s
        # Named provisionally (no memo yet), renamed by the builder's table: nothing hashed.
        assert s["tensors_provisional"] > 0 and s["bytes_hashed"] == 0, s
        # As many look-ups as the builder made, every one a hit.
        assert s["hits"] == builders[0]["misses"] + builders[0]["hits"] > 0, (s, builders[0])
    # The builder named its tensors provisionally too, and hashed them beside its build.
    assert builders[0]["tensors_provisional"] > 0 and builders[0]["bytes_hashed"] > 0, builders[0]
    # One publication per distinct partition, all from the builder (methods that share their
    # weights share one: the builder's second runtime is served from its own publication).
    stats = daemon.stats()
    assert stats["builds"] == builders[0]["built"] and stats.get("builds_given_up", 0) == 0, stats
    if model == "twomethods":
        assert builders[0]["built"] == 1 and builders[0]["served"] == 1, builders[0]
    # Published under the content names, the provisional identity its alias.
    assert stats["aliases_filed"] == builders[0]["built"], stats
    # A later worker is served at once, and so are reloads in it.
    later = run(pte, daemon, packd=True)
    assert later["output_sha256"] == reference["output_sha256"]
    assert later["packd"]["served"] == runtimes and later["packd"]["bytes_packed"] == 0, later
    # By the names the builder remembered: nothing hashed, nothing provisional.
    assert later["packd"]["bytes_hashed"] == 0 and later["packd"]["tensors_provisional"] == 0, later


def test_a_model_that_changes_by_one_weight_never_hits_the_old_packing(ptes, daemon):
    old, new = ptes / "mlp.pte", ptes / "mlp-tweak.pte"
    reference = run(new)
    assert run(old, daemon, packd=True)["packd"]["built"] == 1
    line = run(new, daemon, packd=True)
    assert line["output_sha256"] == reference["output_sha256"], line
    s = line["packd"]
    # Another identity (its names differ): built anew, nothing served from the old packing.
    assert s["built"] == 1 and s["served"] == 0 and s["hits"] == 0, s


def test_packd_away_runs_as_without_it_and_says_why(ptes, tmp_path):
    pte = ptes / "convnet.pte"
    reference = run(pte)
    line = run(pte, packd=True, extra_env={"PACKD_SOCKET_DIR": str(tmp_path / "nowhere")})
    assert line["output_sha256"] == reference["output_sha256"]
    s = line["packd"]
    assert s["private"] == s["runtimes"] >= 1 and s["served"] == 0 and s["built"] == 0, s
    assert any(r.startswith("packd is away") for r in s["reasons"]), s
    # PACKD_XNNPACK=off: enable() does nothing at all.
    off = run(pte, packd=True, extra_env={"PACKD_XNNPACK": "off", "PACKD_SOCKET_DIR": str(tmp_path / "nowhere")})
    assert off["output_sha256"] == reference["output_sha256"]
    assert not off["packd"]["enabled"] and off["packd"]["runtimes"] == 0 and not off["packd"]["hooked"], off


def test_a_builder_killed_before_publishing_hands_the_role_on(ptes, daemon, tmp_path):
    pte = ptes / "mlp.pte"
    reference = run(pte)
    # The builder holds its build (PACKD_XNNPACK_HOLD_BUILD) and is killed; the waiter
    # takes the role over and builds.
    # Held until a file that is never made: only the kill ends it.
    builder = run(pte, daemon, packd=True, wait=False,
                  extra_env={"PACKD_XNNPACK_HOLD_BUILD": str(tmp_path / "never")})
    deadline = time.time() + 120
    while daemon.stats().get("builds", 0) < 1:
        assert time.time() < deadline and builder.poll() is None, "the builder never started building"
        time.sleep(0.1)
    waiter = run(pte, daemon, packd=True, wait=False)
    # Killed only once the waiter waits for it (else the waiter would simply build first).
    while daemon.stats().get("build_waits", 0) < 1:
        assert time.time() < deadline and waiter.poll() is None, "the waiter never waited for the builder"
        time.sleep(0.1)
    builder.kill()
    builder.wait()
    line = finish(waiter)
    assert line["output_sha256"] == reference["output_sha256"]
    assert line["packd"]["built"] == 1, line


def test_a_model_changed_while_its_weights_are_packed_is_never_served(ptes, daemon, tmp_path):
    model = tmp_path / "mlp.pte"
    model.write_bytes((ptes / "mlp.pte").read_bytes())
    reference = run(model)
    go = tmp_path / "go"
    before = daemon.stats()
    builder = run(model, daemon, packd=True, wait=False, extra_env={"PACKD_XNNPACK_HOLD_BUILD": str(go)})
    line = change_during_build(daemon, before, builder, model, go)
    assert line["output_sha256"] == reference["output_sha256"]
    assert line["packd"]["tensors_provisional"] > 0, line["packd"]
    # The changed file has other provisional names: built, then served.
    again = run(model, daemon, packd=True)
    assert again["packd"]["built"] == 1 and again["output_sha256"] == reference["output_sha256"], again
    later = run(model, daemon, packd=True)
    assert later["packd"]["served"] == 1 and later["output_sha256"] == reference["output_sha256"], later


def test_a_restarted_daemon_serves_what_was_published_through_its_cache_directory(ptes, tmp_path):
    from conftest import Daemon

    pte = ptes / "convnet.pte"
    cache = tmp_path / "cache"
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    # The user's names memo outlives the daemon, as ~/.cache/packd/names does.
    memo = {"PACKD_NAMES": str(tmp_path / "names")}
    d = Daemon(first, cache_dir=cache)
    try:
        assert run(pte, d, packd=True, extra_env=memo)["packd"]["built"] >= 1
        # Written once hashed (the builder's names were provisional until then).
        deadline = time.time() + 60
        while not list(cache.glob("*.pack")):
            assert time.time() < deadline, "nothing was written to the cache directory"
            time.sleep(0.05)
    finally:
        d.stop()
    d = Daemon(second, cache_dir=cache)
    try:
        line = run(pte, d, packd=True, extra_env=memo)
        assert line["packd"]["served"] == line["packd"]["runtimes"] and line["packd"]["bytes_packed"] == 0, line
        assert line["packd"]["tensors_remembered"] > 0 and line["packd"]["bytes_hashed"] == 0, line
        assert d.stats()["builds"] == 0
        # With no memo the tensors are named provisionally, and the restarted daemon's copy is
        # under their content names: this worker builds, and packd keeps its first copy.
        fresh = run(pte, d, packd=True, extra_env={"PACKD_NAMES": str(tmp_path / "fresh-names")}, settle=True)
        assert fresh["output_sha256"] == line["output_sha256"]
        assert fresh["packd"]["tensors_provisional"] > 0 and fresh["packd"]["served"] == 0, fresh["packd"]
        # Its publication refused (packd has the model), its status says so: private, not built.
        assert fresh["packd"]["built"] == 0 and fresh["packd"]["private"] == fresh["packd"]["runtimes"], fresh
        assert "publishing failed" in json.dumps(fresh["packd"]["reasons"]), fresh["packd"]
        again = run(pte, d, packd=True, extra_env={"PACKD_NAMES": str(tmp_path / "fresh-names")})
        assert again["packd"]["served"] == again["packd"]["runtimes"] and again["packd"]["bytes_packed"] == 0, again
        assert d.stats()["publishes"] == 0, d.stats()
    finally:
        d.stop()


def test_a_publication_whose_hash_fails_is_withdrawn_and_the_next_worker_builds_again(ptes, tmp_path):
    """Every publication's hash held, then failed (a debug build's test fault): the worker
    served in the window maps the builder's memfd and keeps its bytes; new workers are not
    served them."""
    d = Daemon(tmp_path, env={"PACKD_TEST_HASH_DELAY_MS": "8000", "PACKD_TEST_HASH_FAIL": "*"})
    procs = []
    try:
        pte = ptes / "mlp.pte"
        reference = run(pte)
        lines, waits = at_once(pte, d, n=2, keep=procs)
        assert waits >= 1, "the other worker waited for the builder"
        # Served before packd hashed the publication: the two map one memfd, the builder's.
        assert d.stats().get("publishes_withdrawn", 0) == 0, d.stats()
        inodes = [xnnpack_memfds(p.pid) for p in procs]
        assert len(inodes[0]) == 1 and inodes[0] == inodes[1], inodes
        for line in lines:
            assert line["output_sha256"] == reference["output_sha256"], line
        assert sorted(line["packd"]["built"] > 0 for line in lines) == [False, True], [x["packd"] for x in lines]
        wait_for_stat(d, "publishes_withdrawn", 1)
        later = run(pte, d, packd=True)
        assert later["output_sha256"] == reference["output_sha256"]
        assert later["packd"]["served"] == 0 and later["packd"]["built"] > 0, later
    finally:
        for p in procs:
            p.kill()
            p.wait()
        d.stop()
