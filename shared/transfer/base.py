"""The data-plane interface: two-sided, like SGLang's disaggregation connectors.

A transfer moves one KV payload (opaque bytes) from a sender to a receiver, keyed by a
``transfer_id`` that the bus message (``DecodeRequest.handle``) carries too:

    receiver side (decode worker)              sender side (prefill worker)
    ------------------------------             ----------------------------
    rx = transport.receiver(...)
    host, port = await rx.listen()   -- heartbeat advertises host:port -->
                                               handle = await tx.send(host, port, tid, payload)
                                               bus.request(decode subject, DecodeRequest(handle))
    payload = await rx.take(tid, timeout)      (bytes and handle may arrive in either order)
    with payload: import payload.data          (release() returns the buffer to the pool)

Per-transfer states on the receiver, visible through the non-blocking ``poll()``:

    PENDING (unknown yet) -> TRANSFERRING -> SUCCESS (waiting for take) | FAILED (error kept)

A transfer never yields partial data: a short read, checksum mismatch or timeout is FAILED and
``take()`` raises ``TransferError`` naming the transfer and the cause; the sender's ``send()``
raises too (the receiver acknowledges only verified payloads).
"""

from __future__ import annotations

import abc
import enum
import zlib
from dataclasses import dataclass
from typing import Callable

try:  # xxhash is a declared dependency: the wire checksum (xxh3-128, ~10 GB/s on one core)
    import xxhash as _xxhash
except ImportError:  # pragma: no cover
    _xxhash = None

try:  # blake3 is a declared dependency; crc32 keeps the module importable without it
    import blake3 as _blake3
except ImportError:  # pragma: no cover
    _blake3 = None


class TransferState(enum.Enum):
    PENDING = "pending"            # nothing known about this transfer id yet
    TRANSFERRING = "transferring"  # header received, bytes arriving
    SUCCESS = "success"            # all bytes received and verified; waiting for take()
    FAILED = "failed"              # short read, bad checksum, timeout, too large, ...


class TransferError(Exception):
    """A transfer that did not complete; never accompanied by partial data."""

    def __init__(self, message: str, transfer_id: str = ""):
        super().__init__(f"transfer {transfer_id}: {message}" if transfer_id else message)
        self.transfer_id = transfer_id


class Discarded(TransferError):
    """The receiver dropped the transfer on purpose: its request was aborted (or replaced by a
    newer attempt) while the bytes were on their way. Not a path's failure: not retried."""


class ChecksumError(TransferError):
    """The received bytes do not match the sender's checksum."""


class PeerUnavailable(TransferError):
    """The receiver could not be reached (refused, unreachable, connect timeout)."""


class NotAuthorized(TransferError):
    """The receiver refused the frame: it carries no valid tag under the receiver's data-plane key
    (the sender has none, or another one). No other path gets through either."""


class PathUnavailable(TransferError):
    """The receiver cannot use the path the sender chose (another /dev/shm, no NIXL there):
    nothing was received, the transfer stays PENDING and the sender retries on another path."""


# -- checksums ---------------------------------------------------------------------------------

class Hasher:
    """Incremental checksum; ``name`` in {"xxh3", "blake3", "crc32"}; ``hexdigest()`` ->
    "<name>:<hex>". xxh3 (128-bit XXH3) detects transfer corruption at memory speed — the data
    plane's default; blake3 (cryptographic) is what the KV pool keeps with stored entries."""

    def __init__(self, name: str = "blake3"):
        if name == "xxh3" and _xxhash is None:
            name = "blake3"
        if name == "blake3" and _blake3 is None:
            name = "crc32"
        if name not in ("xxh3", "blake3", "crc32"):
            raise ValueError(f"unknown checksum algorithm {name!r}")
        self.name = name
        self._h = _xxhash.xxh3_128() if name == "xxh3" else _blake3.blake3() if name == "blake3" else None
        self._crc = 0

    def update(self, data) -> None:
        if self._h is not None:
            self._h.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def digest(self) -> bytes:
        if self._h is not None:
            return self._h.digest()  # 16 (xxh3) or 32 (blake3) bytes
        return self._crc.to_bytes(4, "big")

    def hexdigest(self) -> str:
        return f"{self.name}:{self.digest().hex()}"


def default_checksum() -> str:
    """The data plane's checksum: xxh3-128, else blake3, else crc32 (what is installed)."""
    return "xxh3" if _xxhash is not None else "blake3" if _blake3 is not None else "crc32"


def checksum(data, name: str | None = None) -> str:
    """One-shot "<algo>:<hex>" of ``data``."""
    h = Hasher(name or default_checksum())
    h.update(data)
    return h.hexdigest()


# -- payloads ----------------------------------------------------------------------------------

@dataclass
class KVPayload:
    """Received bytes; ``data`` stays valid until ``release()`` (use ``with payload:``)."""
    transfer_id: str
    data: memoryview                       # exactly nbytes, verified against checksum
    checksum: str                          # "<algo>:<hex>" as sent
    seconds: float                         # receive time, first header byte to verified
    _release: Callable[[bool], None] | None = None  # called with reuse=True|False

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def expect(self, checksum: str, nbytes: int) -> "KVPayload":
        """This payload, if it is the one a handle (a bus message) announced: its size and its
        checksum; else it is released and ChecksumError raised — a payload is never used before
        it matches what its sender said on the bus."""
        if self.nbytes != nbytes or self.checksum != checksum:
            got = f"{self.nbytes} bytes, {self.checksum}"
            self.release()
            raise ChecksumError(f"received {got}; the handle announced {nbytes} bytes, {checksum}",
                                self.transfer_id)
        return self

    def release(self) -> None:
        """Give the buffer back for reuse; ``data`` must not be used afterwards.

        If something still aliases ``data`` (a tensor made with ``torch.frombuffer``), the
        buffer is not reused, only forgotten: copy what you keep before releasing.
        """
        rel, self._release = self._release, None
        if rel is not None:
            try:
                self.data.release()
                rel(True)
            except BufferError:
                rel(False)

    def __enter__(self) -> "KVPayload":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# -- the two sides -----------------------------------------------------------------------------

class KVSender(abc.ABC):
    """Pushes payloads to a receiver. One sender serves any number of peers and transfers."""

    @abc.abstractmethod
    async def send(self, host: str, port: int, transfer_id: str, payload, *,
                   checksum: str | None = None, timeout: float | None = None) -> "SendResult":
        """Send ``payload`` (bytes-like) and return once the receiver has verified it.

        Raises PeerUnavailable when the receiver cannot be reached, TransferError otherwise.
        ``checksum`` ("<algo>:<hex>") may be passed when already known.
        """

    async def close(self) -> None:
        """Release connections; further sends fail."""


@dataclass
class SendResult:
    transfer_id: str
    nbytes: int
    checksum: str      # "<algo>:<hex>" for the TransferHandle
    seconds: float     # connect to receiver's acknowledgement
    path: str          # how it went: "shm", "tcp", "tcp+zstd", "rdma"
    wire_bytes: int = 0   # bytes that crossed the path (compressed size for tcp+zstd)
    attempts: int = 1     # paths tried (a failed path is retried on the next)


class KVReceiver(abc.ABC):
    """Accepts payloads from senders and hands them out by transfer id."""

    @abc.abstractmethod
    async def listen(self) -> tuple[str, int]:
        """Start accepting; return the (host, port) senders should use."""

    @abc.abstractmethod
    def poll(self, transfer_id: str) -> TransferState:
        """Non-blocking: where this transfer stands."""

    @abc.abstractmethod
    async def take(self, transfer_id: str, timeout: float | None = None) -> KVPayload:
        """Wait for the verified payload (it may already be here) and remove it from the
        receiver. Raises TransferError on failure or after ``timeout`` seconds."""

    @abc.abstractmethod
    def discard(self, transfer_id: str) -> None:
        """Forget a transfer (request aborted): drop its bytes now or when they arrive."""

    @abc.abstractmethod
    def transfers(self) -> list[str]:
        """The ids of the transfers it holds, receives or waits for (not those discarded)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting, fail pending takes, free buffers."""


class KVTransport(abc.ABC):
    """A data plane: ``tcp.TcpTransport`` (frames), ``select.DataPlane`` (every path, chosen by link)."""

    name: str  # "tcp", "auto"

    @abc.abstractmethod
    def sender(self) -> KVSender: ...

    @abc.abstractmethod
    def receiver(self, host: str, port: int = 0) -> KVReceiver: ...
