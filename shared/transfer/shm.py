"""Same-host payloads through /dev/shm: the sender writes the bytes to a file there, the
receiver maps it and unlinks it at once (the mapping stays valid), so nothing outlives the
transfer: one memory copy instead of a socket's two, no kernel socket buffers in between.

Names are ``tandem-kv-<32 hex>``; a receiver maps nothing else (a peer cannot make it read an
arbitrary file). The sender unlinks its file when the transfer fails before the receiver took it,
or when its send is cancelled while the file is being written (once the write is done); segments a
dead sender left are swept by the next receiver to start (``sweep``).
"""

from __future__ import annotations

import mmap
import os
import re
import uuid

from shared.transfer.base import ChecksumError, PathUnavailable, TransferError
from shared.transfer.frames import check_digest, digest_of, recv_bytes

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^tandem-kv-[0-9a-f]{32}$")


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def shm_write(data) -> str:
    """Write ``data`` to a new /dev/shm file; returns its name."""
    name = f"tandem-kv-{uuid.uuid4().hex}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        mv = memoryview(data).cast("B")
        while mv:  # write(2), not a mapping: no page fault per 4 KiB page
            mv = mv[os.write(fd, mv[:1 << 30]):]
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return name


def shm_map(name: str, nbytes: int) -> mmap.mmap:
    """Map a sender's file (exactly ``nbytes`` long, else ValueError) and unlink it."""
    if not _NAME.match(name):
        raise ValueError(f"not a Tandem shm segment name: {name!r}")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"segment holds {size} bytes, the header says {nbytes}")
        if nbytes == 0:
            raise ValueError("empty shm segment")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # map every page at once
        return mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


STALE_S = 900.0   # a segment lives for one exchange (seconds); one this old was left by a process that died


def sweep(max_age_s: float = STALE_S, now: float | None = None) -> tuple[int, int]:
    """Remove Tandem segments older than ``max_age_s`` (their sender died mid-transfer: a kill -9,
    an OOM): (files, bytes) removed. Each receiver sweeps as it starts listening, so a restart
    gives their RAM back."""
    import time
    now = time.time() if now is None else now
    files = size = 0
    try:
        names = [n for n in os.listdir(SHM_DIR) if _NAME.match(n)]
    except OSError:
        return 0, 0
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.stat(path)
            if now - st.st_mtime >= max_age_s:
                os.unlink(path)
                files, size = files + 1, size + st.st_size
        except OSError:    # gone meanwhile (its receiver took it), or not ours to remove
            continue
    return files, size


def shm_unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


async def read(rx, loop, conn, tid: str, nbytes: int, raw_n: int, algo: str, digest: bytes):
    """Same-host payload: map the sender's /dev/shm file, unlink it, verify it."""
    if nbytes > 255:
        raise TransferError(f"shm segment name of {nbytes} bytes", tid)
    name = await recv_bytes(loop, conn, tid, nbytes, rx.timeout)
    try:
        mm = shm_map(name.decode(errors="replace"), raw_n)
    except (OSError, ValueError) as e:
        raise PathUnavailable(f"shared memory: {e}", tid) from None
    view = memoryview(mm)
    got = await loop.run_in_executor(rx.io, digest_of, algo, view)
    try:
        check_digest(tid, algo, got, digest)
    except ChecksumError:
        view.release()
        mm.close()
        raise

    def release(reuse: bool, m=mm) -> None:
        if reuse:  # unmapping frees the segment's pages (~15 ms for 64 MiB): off the caller's path
            try:
                rx.io.submit(m.close)
            except RuntimeError:  # receiver closed
                m.close()
    return view, got, release

