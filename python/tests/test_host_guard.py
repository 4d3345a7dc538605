"""The session's guard (conftest.py, HostGuard) fails a run that touches a directory it
watches: shown on planted tests run under relocated host directories."""

import os
import shutil
import subprocess
import sys

from conftest import ROOT


def _run(tmp_path, body):
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(ROOT / "python" / "tests" / "conftest.py", suite / "conftest.py")
    (suite / "test_planted.py").write_text(body)
    host = tmp_path / "host"
    (host / "cache").mkdir(parents=True)
    env = dict(os.environ, PACKD_TESTS_HOST_DIRS=f"{host / 'run'}:{host / 'cache'}")
    env.pop("PACKD_TESTS_HOST_GUARD", None)
    env.pop("CI", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)],
                         cwd=suite, env=env, capture_output=True, text=True)
    return out, host


def test_a_test_that_writes_a_watched_directory_fails_the_session(tmp_path):
    out, host = _run(tmp_path, (
        "import os\n"
        "def test_writes_the_cache():\n"
        "    open(os.environ['PACKD_TESTS_HOST_DIRS'].split(':')[1] + '/lock', 'w').write('1')\n"
        "def test_makes_the_runtime_dir():\n"
        "    os.mkdir(os.environ['PACKD_TESTS_HOST_DIRS'].split(':')[0])\n"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 passed" in out.stdout, out.stdout
    assert "something touched the host's packd directories" in out.stdout, out.stdout
    assert str(host / "cache" / "lock") in out.stdout and str(host / "run") in out.stdout, out.stdout


def test_a_session_that_keeps_off_them_passes(tmp_path):
    out, _ = _run(tmp_path, "def test_nothing(tmp_path):\n    (tmp_path / 'x').write_text('1')\n")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "touched" not in out.stdout, out.stdout
