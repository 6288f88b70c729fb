"""Data-plane authentication and limits against a receiver in its own process (real sockets), whose
memory is read from /proc: frames without the deployment's key — four of them declaring 1 GiB
each — and a keyed frame declaring 4 GiB are refused without the receiver's peak RSS growing; a
payload that does not match its checksum is refused. A receiver without a key, sent the same
forged frame, does take it in: the RSS measure sees what the key prevents.

(Migrations and pool gets to addresses that are no live worker's: test_migration.py,
test_kvpool_service.py.)"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shared.transfer import ChecksumError, TcpKVSender, checksum
from shared.transfer.frames import EXTRA, F_AUTH, F_ZSTD, HEADER, MAGIC, frame_tag

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")]

MiB, GiB = 1 << 20, 1 << 30
KEY = os.urandom(32)
PUSH = 64 * MiB          # payload bytes a forger pushes after its header
GROWTH = 16 * MiB        # peak RSS growth that would mean a payload was taken in (it is PUSH per frame)
ROOT = Path(__file__).resolve().parents[2]

RECEIVER = """
import asyncio, sys
from shared.transfer import TcpKVReceiver

async def main():
    rx = TcpKVReceiver("127.0.0.1", 0, max_bytes=int(sys.argv[2]) << 20, timeout=60.0,
                       key=bytes.fromhex(sys.argv[1]))
    _, port = await rx.listen()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)   # until the test closes stdin
    print(rx.refused, flush=True)
    await rx.close()

asyncio.run(main())
"""


class Receiver:
    """A TcpKVReceiver in a child process (``key`` b"": none), budget ``budget_mb``."""

    def __init__(self, key: bytes, budget_mb: int = 1024):
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER, key.hex(), str(budget_mb)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def mem(self, field: str) -> int:
        """VmRSS (now) or VmHWM (peak) of the receiver, bytes."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} in /proc/{self.proc.pid}/status")

    def stop(self) -> int:
        """Stop it; the number of frames it refused."""
        out, _ = self.proc.communicate("", timeout=60)
        return int(out.split()[-1])


def header(tid: bytes, nbytes: int, flags: int | None = None, raw_n: int | None = None) -> bytes:
    """A frame header for ``nbytes`` of payload (version 1, or 2 with ``flags``)."""
    if flags is None:
        return HEADER.pack(MAGIC, 1, 1, len(tid), nbytes, b"\0" * 32) + tid
    return HEADER.pack(MAGIC, 2, 1, len(tid), nbytes, b"\0" * 32) + tid + EXTRA.pack(flags, raw_n)


def verdict(port: int, head: bytes) -> int:
    """Send a frame's header (and tag), read the receiver's status; then push PUSH payload bytes,
    which a refusing receiver never reads (the connection is closed: the push fails early)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head)
        status = s.recv(3)[0]
        try:
            for _ in range(PUSH // MiB):
                s.sendall(bytes(MiB))
        except OSError:
            pass
    return status


def test_forged_and_oversized_frames_are_refused_without_allocating():
    rx = Receiver(KEY, budget_mb=1024)
    try:
        time.sleep(0.2)
        peak = rx.mem("VmHWM")
        # four frames of 1 GiB each, no tag / a tag under another key: refused at the header
        forged = [header(b"f-none-%d" % i, GiB) for i in range(2)]
        wrong = header(b"f-wrong", GiB, F_AUTH, GiB)
        forged += [wrong + frame_tag(b"not the key", f"127.0.0.1:{rx.port}", wrong)]
        zipped = header(b"f-zstd", MiB, F_ZSTD | F_AUTH, GiB)   # a "compressed" 1 GiB, tag of nothing
        forged += [zipped + os.urandom(32)]
        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(lambda h: verdict(rx.port, h), forged))
        assert statuses == [7] * 4   # UNAUTHORIZED
        # authentic frames declaring 4 GiB (raw, or compressed to 1 MiB): beyond the budget
        for head in (header(b"big", 4 * GiB, F_AUTH, 4 * GiB), header(b"big-z", MiB, F_AUTH | F_ZSTD, 4 * GiB)):
            assert verdict(rx.port, head + frame_tag(KEY, f"127.0.0.1:{rx.port}", head)) == 2   # TOO_LARGE
        grew = rx.mem("VmHWM") - peak
        print(f"receiver peak RSS grew by {grew / MiB:.1f} MiB over 6 refused frames")
        assert grew < GROWTH
        # a payload that does not match its checksum: refused (and the frame's bytes were read into
        # a buffer of its declared size only)
        tx = TcpKVSender(timeout=30.0, key=KEY)
        payload = os.urandom(MiB)

        async def send_wrong():
            try:
                await tx.send("127.0.0.1", rx.port, "mismatch", payload, checksum=checksum(payload[::-1]))
            finally:
                await tx.close()
        with pytest.raises(ChecksumError, match="checksum mismatch"):
            asyncio.run(send_wrong())
    finally:
        refused = rx.stop()
    assert refused == 4


def test_without_a_key_the_same_forged_frame_is_taken_in():
    """The control: a receiver without a key reads a forged frame's payload into a buffer of its
    declared size, and the RSS measure above sees it."""
    rx = Receiver(b"", budget_mb=1024)
    try:
        time.sleep(0.2)
        peak = rx.mem("VmHWM")
        with socket.create_connection(("127.0.0.1", rx.port), timeout=60) as s:
            s.sendall(header(b"forged", GiB))
            for _ in range(PUSH // MiB):
                s.sendall(bytes(MiB))
            deadline = time.monotonic() + 60   # a hang only: the bytes were sent, the receiver reads them
            while rx.mem("VmHWM") - peak < PUSH - GROWTH and time.monotonic() < deadline:
                time.sleep(0.05)
            grew = rx.mem("VmHWM") - peak
            print(f"keyless receiver peak RSS grew by {grew / MiB:.1f} MiB taking a forged frame in")
            assert grew >= PUSH - GROWTH
    finally:
        assert rx.stop() == 0
