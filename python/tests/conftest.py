"""Fixtures: a real packd daemon in a temporary socket directory, and model files."""

import json
import os
import pathlib
import struct
import subprocess
import tempfile
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Workers started without a test daemon's memo keep their names memo here, never in the
# user's ~/.cache/packd/names.
os.environ.setdefault("PACKD_NAMES", tempfile.mkdtemp(prefix="packd-test-names-"))


def host_dirs():
    """The directories a packd or a packd worker uses by default (or PACKD_TESTS_HOST_DIRS,
    colon-separated): the tests must touch none of them."""
    listed = os.environ.get("PACKD_TESTS_HOST_DIRS")
    if listed:
        return [pathlib.Path(d) for d in listed.split(":") if d.startswith("/")]
    dirs = [pathlib.Path("/run/packd"), pathlib.Path("/var/cache/packd")]
    if os.environ.get("XDG_RUNTIME_DIR"):
        dirs.append(pathlib.Path(os.environ["XDG_RUNTIME_DIR"]) / "packd")
    if os.environ.get("XDG_CACHE_HOME"):
        dirs.append(pathlib.Path(os.environ["XDG_CACHE_HOME"]) / "packd")
    elif os.environ.get("HOME"):
        dirs.append(pathlib.Path(os.environ["HOME"]) / ".cache" / "packd")
    return dirs


class HostGuard:
    """Watches host_dirs() (with the names memos' directories in them; a missing one for its
    creation) with inotify from the session's start to its end, as the Rust suite's guard
    does: any open, read, write, creation, removal or change of attributes there fails the
    session. PACKD_TESTS_HOST_GUARD=off turns it off."""

    IN_ACCESS, IN_MODIFY, IN_ATTRIB, IN_OPEN = 0x1, 0x2, 0x4, 0x20
    IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
    IN_Q_OVERFLOW, IN_NONBLOCK, IN_CLOEXEC = 0x4000, 0o4000, 0o2000000
    EVENTS = IN_ACCESS | IN_MODIFY | IN_ATTRIB | IN_OPEN | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE

    def __init__(self):
        import ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(self.IN_NONBLOCK | self.IN_CLOEXEC)
        self.watches = {}
        for d in host_dirs():
            if d.is_dir():
                # The names memos by name: listing d would open it under the watch of every
                # other test process's guard.
                subdirs = [d / s for s in ("names", "xnnpack-names") if (d / s).is_dir()]
                for w in [d, *subdirs]:
                    self._watch(w, self.EVENTS, None)
            elif d.parent.is_dir():
                self._watch(d.parent, self.IN_CREATE | self.IN_MOVED_TO, d.name)

    def _watch(self, path, mask, only):
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(str(path)), mask)
        if wd >= 0:
            self.watches.setdefault(wd, (path, only))

    def touched(self):
        seen = set()
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            at = 0
            while at + 16 <= len(buf):
                wd, mask, _cookie, size = struct.unpack_from("iIII", buf, at)
                name = buf[at + 16:at + 16 + size].rstrip(b"\0").decode(errors="replace")
                at += 16 + size
                if mask & self.IN_Q_OVERFLOW:
                    seen.add("(more events than the kernel queues)")
                    continue
                path, only = self.watches.get(wd, (None, None))
                if path is None or (only is not None and name != only):
                    continue
                seen.add(str(path / name) if name else str(path))
        return sorted(seen)


def pytest_sessionstart(session):
    if os.environ.get("PACKD_TESTS_HOST_GUARD") != "off":
        session.config._packd_host_guard = HostGuard()


def pytest_sessionfinish(session, exitstatus):
    """Under CI (CI=true), where .ci/run installs everything these tests use, a skipped test
    fails the run: a missing capability must not pass as green. A test that touched the
    host's packd directories fails it too."""
    guard = getattr(session.config, "_packd_host_guard", None)
    touched = guard.touched() if guard else []
    if touched:
        print("\npackd tests: something touched the host's packd directories "
              f"({', '.join(str(d) for d in host_dirs())}): {', '.join(touched)}. Every daemon, packctl "
              "and worker a test starts needs directories of its own (--socket-dir, --cache-dir, "
              "PACKD_NAMES); if a daemon of yours was busy during the run, run again while it is "
              "idle, or set PACKD_TESTS_HOST_GUARD=off.")
        session.exitstatus = 1
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if os.environ.get("CI") == "true" and skipped and exitstatus == 0:
        for report in skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
            print(f"\nCI: skipped, which CI does not allow: {report.nodeid}: {reason}")
        session.exitstatus = 1


def _binary(env, name):
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    path = pathlib.Path(os.environ.get(env) or target / "debug" / name)
    if not path.exists():
        pytest.fail(f"{path} does not exist: build it (cargo build --workspace) or set {env}")
    return path


class Daemon:
    def __init__(self, tmp_path, cache_dir="off", env=None):
        self.dir = tmp_path / "sockets"
        self.dir.mkdir()
        self.log = open(tmp_path / "packd.log", "w")
        packd = _binary("PACKD_BIN", "packd")
        # Test daemons share one kernels file, as the Rust tests' do: on a CPU with two SIMD
        # ISAs the first measures, the others read it.
        env = dict(os.environ, PACKD_KERNELS_FILE=str(packd.resolve().parent / "packd-test-kernels" / "kernels"),
                   **(env or {}))
        self.proc = subprocess.Popen([str(packd), "--socket-dir", str(self.dir), "--cache-dir", str(cache_dir)],
                                     stderr=self.log, env=env)
        # Generous for a loaded machine; a daemon that exits fails at once.
        deadline = time.time() + 120
        while not ((self.dir / "packd.sock").exists() and (self.dir / "control.sock").exists()):
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("packd did not start; see " + str(tmp_path / "packd.log"))
            time.sleep(0.02)

    def stats(self):
        out = subprocess.run([str(_binary("PACKCTL_BIN", "packctl")), "--socket-dir", str(self.dir),
                              "stats", "--json"], check=True, capture_output=True).stdout
        return json.loads(out)

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def wait_for_stat(daemon, name, at_least, seconds=60):
    """Waits until `daemon`'s counter `name` reaches `at_least`."""
    deadline = time.time() + seconds
    while daemon.stats().get(name, 0) < at_least:
        assert time.time() < deadline, f"{name} never reached {at_least}: {daemon.stats()}"
        time.sleep(0.05)


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


def change_during_build(daemon, before, builder, model, go):
    """Once `builder` (a worker held at its build until `go` exists) holds its builder role,
    changes `model`'s times (as a write would) and lets the build go on; then checks what
    the builder says of it and that nothing was published: its copy stays private
    (`unnamed_weights`, the file changed) and its role was given up."""
    deadline = time.time() + 120
    while daemon.stats().get("builds", 0) - before.get("builds", 0) < 1:
        assert time.time() < deadline and builder.poll() is None, "the builder never took its role"
        time.sleep(0.05)
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    go.touch()
    out, err = builder.communicate(timeout=300)
    assert builder.returncode == 0, f"worker failed ({builder.returncode}): {out}{err[-3000:]}"
    line = json.loads(out.strip().splitlines()[-1])
    p = line["packd"]
    assert (p["built"], p["private"]) == (0, 1), p
    assert p["fallbacks"].get("unnamed_weights") == 1 and any("changed" in r for r in p["reasons"]), p
    stats = daemon.stats()
    assert stats["publishes"] == before.get("publishes", 0), stats
    assert stats.get("aliases_filed", 0) == before.get("aliases_filed", 0), stats
    assert stats["builds_given_up"] - before.get("builds_given_up", 0) == 1, stats
    return line


def write_safetensors(path, tensors):
    """Writes {name: np.ndarray} as a safetensors file (little-endian, in the given order)."""
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64",
             np.dtype(np.uint8): "U8"}
    header, data, offset = {}, b"", 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.fixture
def model_file(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {
        "embed.weight": rng.standard_normal((11, 8), dtype=np.float32),
        "layer.0.dense.weight": rng.standard_normal((17, 8), dtype=np.float32),
        "layer.0.dense.bias": rng.standard_normal(17, dtype=np.float32),
        "layer.1.norm.weight": rng.standard_normal(5).astype(np.float16),
        "position_ids": np.arange(6, dtype=np.int64).reshape(1, 6),
    }
    path = tmp_path / "model.safetensors"
    write_safetensors(path, tensors)
    return path, tensors
