"""The packd Python package against a real daemon: packing, zero-copy read-only arrays,
lifetime of the mapping, errors, and threads sharing one client."""

import gc
import os
import threading
import time

import numpy as np
import pytest

import packd


def data_address(arr):
    return arr.__array_interface__["data"][0]


def test_load_file_returns_the_files_tensors_as_read_only_views(daemon, model_file):
    path, tensors = model_file
    arrays = packd.load_file(path, socket_dir=daemon.dir)
    assert list(arrays) == list(tensors)
    for name, want in tensors.items():
        got = arrays[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable
        with pytest.raises(ValueError):
            got[(0,) * got.ndim] = 1


def test_arrays_view_the_shared_mapping_without_a_copy(daemon, model_file):
    path, tensors = model_file
    client = packd.Client(daemon.dir)
    model = client.pack(path, layout="identity")
    start, end = model.address, model.address + model.size
    for e in model.entries:
        arr = model.tensor(e.name)
        assert data_address(arr) == start + e.offset, e.name
        assert start <= data_address(arr) and data_address(arr) + arr.nbytes <= end
    # The same segment from another connection: the same key, another mapping of it.
    again = packd.Client(daemon.dir).get(model.key)
    assert again.key == model.key
    np.testing.assert_array_equal(again.tensor("embed.weight"), tensors["embed.weight"])


def test_the_mapping_lives_while_an_array_does(daemon, model_file):
    path, tensors = model_file
    with packd.Client(daemon.dir) as client:
        with client.pack(path, layout="identity") as model:
            w = model.tensor("layer.0.dense.weight")
        assert "released" in repr(model)
        with pytest.raises(ValueError):
            model.tensor("layer.0.dense.weight")
    gc.collect()
    np.testing.assert_array_equal(w, tensors["layer.0.dense.weight"])
    assert daemon.stats()["leases"] == 1
    del w
    gc.collect()
    # The lease ends with the last array: the release reaches the daemon asynchronously.
    for _ in range(200):
        if daemon.stats()["leases"] == 0:
            break
        time.sleep(0.05)
    assert daemon.stats()["leases"] == 0


def test_gemm_layouts_give_the_packed_bytes(daemon, model_file):
    path, _ = model_file
    model = packd.Client(daemon.dir).pack(path, layout="f32-gemm:nr=8,kr=1,sr=1")
    entry = {e.name: e for e in model.entries}["layer.0.dense.weight"]
    assert entry.layout == "f32-gemm:nr=8,kr=1,sr=1" and entry.bias == "layer.0.dense.bias"
    packed = model.tensor("layer.0.dense.weight")
    assert packed.dtype == np.float32 and packed.shape == (entry.length // 4,)
    model.verify()
    # The bias was folded into the weight's entry: it has no entry of its own.
    assert "layer.0.dense.bias" not in model.names()
    with pytest.raises(KeyError, match="folded into the entry of 'layer.0.dense.weight'"):
        model.tensor("layer.0.dense.bias")


def test_a_file_descriptor_works_and_stays_the_callers(daemon, model_file):
    path, tensors = model_file
    fd = os.open(path, os.O_RDONLY)
    try:
        model = packd.Client(daemon.dir).pack(fd, layout="identity")
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    np.testing.assert_array_equal(model.tensor("position_ids"), tensors["position_ids"])


def test_errors_carry_the_code_and_the_message(daemon, model_file, tmp_path):
    path, _ = model_file
    client = packd.Client(daemon.dir)
    with pytest.raises(packd.PackdError) as e:
        client.get("b3:no-such-key")
    assert e.value.code == "NOT_FOUND" and "no segment or entry" in e.value.message
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(packd.PackdError) as e:
        client.pack(junk)
    assert e.value.code == "BAD_SOURCE"
    with pytest.raises(packd.PackdError) as e:
        client.pack(path, layout="no-such-layout")
    assert e.value.code == "INVALID_ARGUMENT" and "no-such-layout" in e.value.message
    # Failures of the OS are the OSError subclasses their errno selects, with the code too.
    with pytest.raises(FileNotFoundError) as e:
        packd.Client(tmp_path / "nowhere")
    assert e.value.code == "CONNECT" and e.value.errno == 2 and "is packd running?" in e.value.message
    assert e.value.filename == str(tmp_path / "nowhere" / "packd.sock")
    with pytest.raises(FileNotFoundError) as e:
        packd.load_file(tmp_path / "missing.safetensors", socket_dir=daemon.dir)
    assert e.value.code == "OPEN" and e.value.errno == 2
    assert e.value.filename == str(tmp_path / "missing.safetensors")
    # The exception names its module as users import it.
    err = packd.PackdError("x")
    assert type(err).__module__ == "packd" and repr(type(err)) == "<class 'packd.PackdError'>"
    with pytest.raises(KeyError):
        client.pack(path).tensor("missing")
    with pytest.raises(TypeError):
        client.pack(3.5)
    with pytest.raises(TypeError):
        client.pack(True)  # would be fd 1 (stdout) if taken as an int
    with pytest.raises(ValueError):
        packd.Client(daemon.dir, timeout=-1)
    # A directory is refused as open() refuses to read one; an empty socket_dir is no
    # directory at all (None means the default).
    with pytest.raises(IsADirectoryError) as e:
        client.pack(tmp_path)
    assert e.value.code == "OPEN" and e.value.errno == 21
    with pytest.raises(ValueError, match="socket_dir is empty"):
        packd.Client("")
    # One rule as a string is not split into one-character rules.
    with pytest.raises(TypeError, match="list of 'GLOB=LAYOUT' strings"):
        client.pack(path, rules="*.bias=identity")
    # A folded bias says how to get it: a rule on its weight (one on the bias does nothing).
    gemm = client.pack(path, rules=["*.bias=identity"])
    with pytest.raises(KeyError, match="layer.0.dense.weight=identity"):
        gemm.tensor("layer.0.dense.bias")
    plain = client.pack(path, rules=["layer.0.dense.weight=identity"])
    assert plain.tensor("layer.0.dense.bias").shape == (17,)
    # A closed client says so.
    client.close()
    with pytest.raises(ValueError, match="closed"):
        client.get("b3:no-such-key")


def test_calls_on_a_daemon_that_never_answers_time_out(model_file, tmp_path):
    """A stand-in daemon accepts connections and reads requests but never answers: each
    call raises PackdError("TIMEOUT") after its deadline instead of hanging."""
    import socket

    path, _ = model_file
    sockets = tmp_path / "silent"
    sockets.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sockets / "packd.sock"))
    server.listen(8)
    held = []

    def accept():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    try:
        client = packd.Client(sockets, timeout=0.2, pack_timeout=0.3)
        with pytest.raises(packd.PackdError) as e:
            client.get("b3:nothing")
        assert e.value.code == "TIMEOUT" and "a get request within 200ms" in e.value.message
        with pytest.raises(packd.PackdError) as e:
            client.pack(path)
        assert e.value.code == "TIMEOUT" and "a pack request within 200ms" in e.value.message
    finally:
        server.close()
        for conn in held:
            conn.close()


def test_a_pack_reports_its_progress_to_a_callback(daemon, model_file):
    path, tensors = model_file
    client = packd.Client(daemon.dir)
    seen = []
    model = client.pack(path, layout="identity", progress=lambda stage, done, total: seen.append((stage, done, total)))
    np.testing.assert_array_equal(model.tensor("embed.weight"), tensors["embed.weight"])
    # The daemon acknowledges every pack before it starts.
    assert seen and seen[0][0] == "accepted", seen
    size = os.path.getsize(path)
    assert all(stage in ("accepted", "waiting", "hashing", "packing") and done <= total <= size
               for stage, done, total in seen), seen
    with pytest.raises(TypeError):
        client.pack(path, progress="not callable")


def test_threads_share_one_client(daemon, model_file):
    path, tensors = model_file
    client = packd.Client(daemon.dir)
    key = client.pack(path, layout="identity").key
    failures = []

    def worker():
        try:
            for _ in range(40):
                m = client.get(key)
                np.testing.assert_array_equal(m.tensor("embed.weight"), tensors["embed.weight"])
                m.release()
        except Exception as exc:  # reported below
            failures.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_dir_of_the_package_shows_only_its_api():
    assert dir(packd) == sorted(packd.__all__)
    assert "np" not in dir(packd) and "os" not in dir(packd)


def test_a_report_shows_in_the_daemons_stats_and_clients(daemon):
    import json
    import subprocess
    from conftest import _binary

    client = packd.Client(daemon.dir)
    client.report("my-engine", "my-model", "private", "unnamed_weights", detail="nothing to name",
                  private_bytes=12345)
    client.report("my-engine", "other-model", "served", shared_bytes=4096)
    with pytest.raises(ValueError, match="unknown reason"):
        client.report("my-engine", "m", "private", "no-such-reason")
    with pytest.raises(ValueError, match="needs a reason"):
        client.report("my-engine", "m", "private")
    deadline = time.time() + 5
    while daemon.stats()["private_fallbacks"].get("unnamed_weights") != 1:
        assert time.time() < deadline, daemon.stats()
        time.sleep(0.02)
    s = daemon.stats()
    assert (s["workers_private"], s["private_bytes"]) == (1, 12345)
    out = subprocess.run([str(_binary("PACKCTL_BIN", "packctl")), "--socket-dir", str(daemon.dir),
                          "clients", "--json"], check=True, capture_output=True).stdout
    (me,) = json.loads(out)["clients"]
    assert me["pid"] == os.getpid()
    got = {(r["model"], r["obtained"], r["fallback"]) for r in me["reports"]}
    assert got == {("my-model", "private", "unnamed_weights"), ("other-model", "served", None)}
    client.close()


def test_a_forked_child_calls_on_a_connection_of_its_own_and_keeps_the_parents_leases(daemon, model_file):
    path, tensors = model_file
    client = packd.Client(daemon.dir)
    model = client.pack(path, layout="identity")
    w = model.tensor("embed.weight")
    gemm_key = client.pack(path).key
    for _ in range(200):
        if daemon.stats()["leases"] == 1:
            break
        time.sleep(0.05)
    assert daemon.stats()["leases"] == 1
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            # The inherited arrays read as before; the inherited client's calls go on a
            # connection of the child's own, so the two processes' replies never cross.
            ok = np.array_equal(w, tensors["embed.weight"])
            for _ in range(200):
                m = client.pack(path, layout="identity")
                ok = ok and m.key == model.key
                m.release()
            # Dropping inherited models ends no lease of the parent's.
            del w, model
            gc.collect()
            status = 0 if ok else 3
        finally:
            os._exit(status)
    crossed = 0
    for _ in range(200):
        m = client.pack(path)
        crossed += m.key != gemm_key
        m.release()
    _, status = os.waitpid(pid, 0)
    assert (crossed, os.waitstatus_to_exitcode(status)) == (0, 0)
    # Once the child's own connection is gone, the parent's lease is still counted.
    for _ in range(200):
        if daemon.stats()["clients"] == 1:
            break
        time.sleep(0.05)
    stats = daemon.stats()
    assert (stats["clients"], stats["leases"]) == (1, 1), stats
    np.testing.assert_array_equal(w, tensors["embed.weight"])
