"""Segments an engine published (docs/PROTOCOL.md, "acquire and publish"), seen from Python:
the publisher and identity, entries of layout "engine" whose bytes are 1-D uint8 views, and
their digests. The publication is made by a real client process (the test publisher that
`cargo test --workspace` builds), as an engine would make it."""

import json
import os
import pathlib
import subprocess

import numpy as np

import packd

ROOT = pathlib.Path(__file__).resolve().parents[2]


def publisher_bin():
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    return os.environ.get("PACKD_PUBLISHER_BIN") or str(target / "debug" / "publisher")


def test_a_published_segment_shows_its_publisher_and_its_engine_entries(daemon, model_file):
    out = subprocess.run([publisher_bin(), str(daemon.dir), "py-identity",
                          "--entries", "3", "--seed", "9"], check=True, capture_output=True, text=True).stdout
    line = json.loads(out.splitlines()[0])
    assert line["got"] == "built", line
    model = packd.Client(daemon.dir).get(line["key"])
    assert model.publisher["identity"] == "py-identity"
    # The publisher ran as this user, with this process's supplementary groups: the
    # daemon's record of it (SO_PEERCRED, SO_PEERGROUPS).
    assert (model.publisher["uid"], model.publisher["gid"]) == (os.getuid(), os.getgid()), model.publisher
    assert sorted(model.publisher["groups"]) == sorted(os.getgroups()), model.publisher
    assert [e.layout for e in model.entries] == ["engine"] * 3
    assert [e.dtype for e in model.entries] == ["U8"] * 3
    for i, e in enumerate(model.entries):
        arr = model.tensor(e.name)
        assert arr.dtype == np.uint8 and arr.shape == (100 + i,) and not arr.flags.writeable
        want = (9 + i + np.arange(100 + i)) % 256
        np.testing.assert_array_equal(arr, want.astype(np.uint8))
    model.verify()
    stats = daemon.stats()
    assert stats["published_segments"] == 1 and stats["publishes"] == 1, stats
    # packd's own segments have no publisher.
    path, _ = model_file
    assert packd.Client(daemon.dir).pack(path).publisher is None
