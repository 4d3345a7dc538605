#!/usr/bin/env python3
"""Measures packd beside hostile clients: for each attack, a well-behaved worker's get + map
latency (max and p99) while the attack runs, the daemon's memory (VmRSS) and fd count
before, during and after, and the log bytes it wrote. Figures for docs/SECURITY.md.

    python3 tests/attacks/attacks.py [--packd target/release/packd] [--connections 2000]

Starts its own packd (release build by default) in a temporary directory; needs only the
Python standard library and packctl (beside packd), whose hidden `packctl frame` builds
every frame with packd's own codec. Latencies are of one run on this machine, reported beside the same
worker's latency with no attack (the baseline, measured in the same run).
"""
import argparse
import array
import json
import mmap
import multiprocessing
import os
import resource
import socket
import struct
import subprocess
import sys
import tempfile
import time

ARGS = None  # the parsed command line


def frame(*args, stdin=None):
    """A data-plane frame (or a decoded field) built by packd's own codec: `packctl frame
    ARGS` prints it as hex, so this script never spells the protocol itself."""
    out = subprocess.run([ARGS.packctl, "frame", *args], input=stdin, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def frame_bytes(*args):
    return bytes.fromhex(frame(*args))


def pack_request(rid):
    return frame_bytes("pack", "--id", str(rid))


def get_request(rid, key):
    return frame_bytes("get", "--key", key, "--id", str(rid))


def recv_exact(sock, n, fds):
    buf = bytearray()
    while len(buf) < n:
        data, anc, _flags, _ = sock.recvmsg(n - len(buf), socket.CMSG_SPACE(4 * 4))
        if not data:
            raise EOFError("daemon closed the connection")
        for level, kind, cdata in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(cdata[: len(cdata) - len(cdata) % 4])
                fds.extend(a)
        buf += data
    return bytes(buf)


def recv_reply(sock):
    fds = []
    (n,) = struct.unpack("<I", recv_exact(sock, 4, fds))
    return recv_exact(sock, n, fds), fds


def segment_key(reply):
    """The key of the segment a reply (its payload) carries."""
    return frame("reply-key", stdin=reply.hex())


def pack_over(sock_path, path):
    """Packs the model at `path` on a new data-plane connection; returns the connection
    (which holds the lease) and the segment key."""
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(sock_path)
    with open(path, "rb") as mf:
        c.sendmsg([pack_request(1)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [mf.fileno()]))])
    reply, fds = recv_reply(c)
    for fd in fds:
        os.close(fd)
    return c, segment_key(reply)


class Worker:
    """A well-behaved worker: get + map + touch + unmap on one connection, timed."""

    def __init__(self, sock_path, key):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sock_path)
        self.key = key
        self.rid = 0

    def attach(self):
        self.rid += 1
        t = time.perf_counter()
        self.sock.sendall(get_request(self.rid, self.key))
        _reply, fds = recv_reply(self.sock)
        if len(fds) != 1:
            raise RuntimeError(f"get answered without an fd: {_reply[:200]!r}")
        size = os.fstat(fds[0]).st_size
        m = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
        _ = m[0]
        m.close()
        os.close(fds[0])
        return time.perf_counter() - t


def run_worker(sock_path, key, stop, out):
    """In a process of its own, so the attacker's own work (building a 300 000-tensor header
    holds Python's GIL for a second) never shows up in the worker's latency."""
    worker = Worker(sock_path, key)
    lat = []
    while not stop.is_set():
        lat.append(worker.attach())
        time.sleep(0.002)
    out.send(lat)
    out.close()


def stats(lat):
    lat = sorted(lat)
    if not lat:
        return "no samples"
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
    return f"n={len(lat)} p50={lat[len(lat) // 2] * 1e3:.2f} ms p99={p99 * 1e3:.2f} ms max={lat[-1] * 1e3:.2f} ms"


def proc(pid, field_name):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def fds_of(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def control_stats(home):
    out = subprocess.run([ARGS.packctl, "--socket-dir", home, "stats", "--json"], check=True,
                         capture_output=True).stdout
    return json.loads(out)


def safetensors(path):
    # One f32 [64, 64] weight: a small model to attach to.
    data = struct.pack("<4096f", *([0.5] * 4096))
    header = b'{"w.weight":{"dtype":"F32","shape":[64,64],"data_offsets":[0,16384]}}'
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packd", default="target/release/packd")
    ap.add_argument("--packctl", default="target/release/packctl")
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each timed attack")
    ap.add_argument("--only", metavar="WORDS", default="",
                    help="run only the attacks whose title contains WORDS (the baseline always runs)")
    args = ap.parse_args()
    global ARGS
    ARGS = args
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    home = tempfile.mkdtemp(prefix="packd-attacks-")
    conf = os.path.join(home, "packd.toml")
    with open(conf, "w") as f:
        # Room for every hostile connection of one uid, so memory is measured at its worst.
        f.write(f"[limits]\nmax_connections_per_uid = {args.connections + 100}\n")
    log_path = os.path.join(home, "packd.log")
    log = open(log_path, "w")
    daemon = subprocess.Popen([args.packd, "--socket-dir", home, "--config", conf], stderr=log)
    sock_path = os.path.join(home, "packd.sock")
    for _ in range(200):
        if os.path.exists(os.path.join(home, "control.sock")):
            break
        time.sleep(0.05)
    time.sleep(0.2)
    model = os.path.join(home, "m.safetensors")
    safetensors(model)
    s, key = pack_over(sock_path, model)
    pid = daemon.pid

    def timed(name, attack, cleanup=None):
        if args.only and args.only not in name and not name.startswith("baseline"):
            return
        ctx = multiprocessing.get_context("fork")
        stop = ctx.Event()
        results, out = ctx.Pipe(duplex=False)
        rss0, fd0, log0 = proc(pid, "VmRSS"), fds_of(pid), os.path.getsize(log_path)
        t = ctx.Process(target=run_worker, args=(sock_path, key, stop, out))
        t.start()
        out.close()
        time.sleep(0.1)  # the worker connects before the attack starts
        held = attack()
        rss1, fd1 = proc(pid, "VmRSS"), fds_of(pid)
        stop.set()
        lat = results.recv()
        t.join()
        if cleanup:
            cleanup(held)
        time.sleep(2.0)
        rss2, fd2, log2 = proc(pid, "VmRSS"), fds_of(pid), os.path.getsize(log_path)
        print(f"{name}")
        print(f"  worker get+map during the attack: {stats(lat)}")
        print(f"  daemon VmRSS: before {rss0 / 1024:.1f} MiB, during {rss1 / 1024:.1f} MiB "
              f"(+{(rss1 - rss0) / 1024:.1f}), 2 s after {rss2 / 1024:.1f} MiB (+{(rss2 - rss0) / 1024:.1f})")
        print(f"  daemon fds: before {fd0}, during {fd1}, after {fd2}; log +{log2 - log0} bytes")
        sys.stdout.flush()

    # Baseline: no attack.
    timed("baseline (no attack)", lambda: time.sleep(args.seconds))

    header_64k = frame_bytes("header", "65536")

    def half_frames():
        conns = []
        body = b"\0" * 60000
        for _ in range(args.connections):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(sock_path)
            c.setblocking(False)
            try:
                c.send(header_64k + body)
            except BlockingIOError:
                pass
            conns.append(c)
        time.sleep(args.seconds)
        return conns

    timed(f"{args.connections} connections each holding a half-sent 64 KiB frame", half_frames,
          lambda conns: [c.close() for c in conns])

    def idle():
        conns = []
        for _ in range(args.connections):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(sock_path)
            conns.append(c)
        time.sleep(args.seconds)
        return conns

    timed(f"{args.connections} idle connections", idle, lambda conns: [c.close() for c in conns])

    def releases():
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(sock_path)
        rel = frame_bytes("release", "--segment-id", "999", "--generation", "1")
        batch = rel * 5000
        end = time.time() + args.seconds
        n = 0
        while time.time() < end:
            c.sendall(batch)
            n += 5000
        print(f"  ({n} releases sent)")
        return c

    timed("a flood of release frames on one connection", releases, lambda c: c.close())

    def bad_requests():
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(sock_path)
        bad = frame_bytes("payload", "ffffffff")
        for _ in range(40):
            c.sendall(bad * 1000)
            for _ in range(1000):
                recv_reply(c)
        return c

    timed("40 000 malformed requests", bad_requests, lambda c: c.close())

    def fd_flood():
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(sock_path)
        null = os.open("/dev/null", os.O_RDONLY)
        fds = array.array("i", [null] * 253)
        c.sendmsg([frame_bytes("header", "60000")], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        c.setblocking(False)
        sent = 0
        end = time.time() + args.seconds
        while time.time() < end:
            try:
                c.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                sent += 253
            except (BlockingIOError, OSError):
                time.sleep(0.01)
        os.close(null)
        print(f"  ({sent} fds sent behind an unfinished frame)")
        return c

    timed("a frame header, then thousands of fds", fd_flood, lambda c: c.close())

    def tiny_tensors():
        # 300 000 one-byte tensors: a 19 MB segment with a ~270 MB entry table, which the
        # budget is charged for; then 50 gets whose replies are never read (they share one
        # encoding).
        n = 300000
        path = os.path.join(home, "tiny.safetensors")
        header = json.dumps({f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
                             for i in range(n)}).encode()
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header + bytes(i & 255 for i in range(n)))
        c, tiny_key = pack_over(sock_path, path)
        charged = control_stats(home)["bytes_resident"]
        print(f"  (segment of 300 000 entries packed; bytes_resident {charged / 2**20:.1f} MiB "
              f"including the small model)")
        c.setblocking(False)
        for i in range(50):
            try:
                c.send(get_request(100 + i, tiny_key))
            except BlockingIOError:
                break
        time.sleep(args.seconds)
        return c, tiny_key

    def drop_tiny(held):
        c, tiny_key = held
        c.close()
        time.sleep(0.5)
        subprocess.run([args.packctl, "--socket-dir", home, "evict", tiny_key], check=True,
                       stdout=subprocess.DEVNULL)
        # The allocator's free heap is given back every 5 s.
        time.sleep(5.5)

    timed("300 000 one-byte tensors, then 50 gets never read; evicted after", tiny_tensors, drop_tiny)

    daemon.terminate()
    daemon.wait()
    log.close()


if __name__ == "__main__":
    main()
