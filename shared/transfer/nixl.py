"""The RDMA path: NIXL (optional extra ``rdma``: ``pip install --no-deps nixl nixl-cu12``).

The receiver pulls, as with shm: the sender registers the payload's memory with its NIXL agent
and sends an ``F_NIXL`` frame (``tcp.py``) whose body is ``!QQ`` (address, length) followed by
the agent's partial metadata (connection info and that one region); the receiver registers a
pooled buffer, loads the metadata, posts one NIXL READ, verifies the checksum and replies over
TCP as for any frame. The sender deregisters its memory once it has the verdict. The TCP
connection carries only the header, the descriptor and the verdict.

UCX (bundled with ``nixl-cu12``) picks the transport: RDMA verbs where an InfiniBand / RoCE
port is ACTIVE, its shared-memory or TCP transports otherwise — so the path runs (slowly) and
is tested on machines without RDMA, while ``DataPlaneSender`` selects it only where
``link.rdma_ports()`` finds an ACTIVE port.

Agents run without NIXL's progress thread (it spins a core for as long as the agent exists:
1.96 s of CPU in 2 s idle, measured) and without thread synchronisation: every agent call
happens on the event loop's thread. The receiver drives its READ by polling it; the sender
polls its agent while it waits for the verdict (UCX's non-RDMA transports need the target's
progress to complete a READ; verbs do not).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import time
import uuid

import numpy as np

from shared.transfer.base import ChecksumError, PathUnavailable, TransferError
from shared.transfer.frames import check_digest, digest_of, recv_bytes

log = logging.getLogger(__name__)

OFFER = struct.Struct("!QQ")   # remote address, length; the agent's partial metadata follows
MAX_OFFER_BYTES = 64 * 1024    # a frame body larger than this is not an offer
POLL_S = 0.0002                # completion polling interval


@functools.cache
def available() -> bool:
    """``nixl`` imports with a backend (a few seconds the first time: it probes CUDA)."""
    try:
        import nixl._api  # noqa: F401
    except Exception as e:  # ImportError, or a backend that fails to load
        log.debug("NIXL unavailable: %s", e)
        return False
    return True


def why_unavailable() -> str:
    return "" if available() else "nixl is not installed (pip install --no-deps nixl nixl-cu12)"


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


class NixlEndpoint:
    """One NIXL agent with the UCX backend, created on first use."""

    def __init__(self, role: str):
        self.name = f"tandem-{role}-{uuid.uuid4().hex[:12]}"
        self.stuck: list[memoryview] = []   # buffers of READs that could not be cancelled
        self._agent = None

    def agent(self):
        if self._agent is None:
            if not available():
                raise PathUnavailable(why_unavailable())
            from nixl._api import nixl_agent, nixl_agent_config
            try:
                agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
            except Exception as e:
                raise PathUnavailable(f"NIXL agent could not start: {e}") from None
            if "UCX" not in agent.backends:
                raise PathUnavailable("NIXL has no UCX backend here")
            self._agent = agent
        return self._agent

    def offer(self, view: memoryview) -> tuple[bytes, callable]:
        """Register ``view`` for a remote READ: (frame body, deregister)."""
        agent = self.agent()
        addr, n = _address(view), view.nbytes
        reg = agent.register_memory([(addr, n, 0, "")], "DRAM")
        try:
            body = OFFER.pack(addr, n) + agent.get_partial_agent_metadata(reg, True)
        except Exception:
            agent.deregister_memory(reg)
            raise
        return body, lambda: agent.deregister_memory(reg)

    async def progressing(self, aw):
        """Await ``aw`` while progressing this agent every ``POLL_S`` (the sender's side of a READ)."""
        task = asyncio.ensure_future(aw)
        try:
            while not task.done():
                self._agent.get_new_notifs()
                await asyncio.wait([task], timeout=POLL_S)
        finally:
            if not task.done():
                task.cancel()
        return task.result()

    async def pull(self, body: bytes, dst: memoryview, timeout: float, transfer_id: str = "") -> None:
        """READ the region an offer describes into ``dst`` (exactly its length); TransferError
        when the READ fails or takes longer than ``timeout`` seconds."""
        if len(body) < OFFER.size:
            raise TransferError(f"NIXL offer of {len(body)} bytes", transfer_id)
        addr, n = OFFER.unpack_from(body)
        if n != dst.nbytes:
            raise TransferError(f"NIXL offer of {n} bytes, the header says {dst.nbytes}", transfer_id)
        agent = self.agent()
        try:
            remote = agent.add_remote_agent(bytes(body[OFFER.size:]))
        except Exception as e:
            raise TransferError(f"NIXL metadata not loadable: {e}", transfer_id) from None
        local = _address(dst)
        reg = agent.register_memory([(local, n, 0, "")], "DRAM")
        handle = None
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs([(local, n, 0)], "DRAM"),
                                           agent.get_xfer_descs([(addr, n, 0)], "DRAM"), remote)
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL READ not done within {timeout}s", transfer_id)
                await asyncio.sleep(POLL_S)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL READ failed ({state})", transfer_id)
        except TransferError:
            raise
        except Exception as e:  # nixl's own errors: bad descriptor, unknown agent, backend error
            raise TransferError(f"NIXL READ: {type(e).__name__}: {e}", transfer_id) from None
        finally:
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)
                except Exception as e:  # a READ still in flight: its buffer must never be reused
                    self.stuck.append(dst)
                    log.error("NIXL READ of %s could not be cancelled (%s): its buffer is kept", transfer_id, e)
                    raise TransferError(f"NIXL READ stuck: {e}", transfer_id) from None
            agent.deregister_memory(reg)


async def read(rx, loop, conn, tid: str, nbytes: int, raw_n: int, algo: str, digest: bytes):
    """RDMA payload: READ the sender's registered memory into a pooled buffer, verify it."""
    if nbytes > MAX_OFFER_BYTES:
        raise TransferError(f"NIXL offer of {nbytes} bytes", tid)
    offer = await recv_bytes(loop, conn, tid, nbytes, rx.timeout)
    rx.nixl.agent()  # PathUnavailable (no NIXL here) before taking a buffer: retry elsewhere
    buf = await rx.buffer(raw_n, tid)
    view = memoryview(buf)[:raw_n]
    try:
        await rx.nixl.pull(offer, view, rx.timeout, tid)
    except TransferError:
        if any(v is view for v in rx.nixl.stuck):
            rx.pool.release(buf, reuse=False)  # RDMA may still write into it
        else:
            rx.give_back(view, buf)
        raise
    got = await loop.run_in_executor(rx.io, digest_of, algo, view)
    try:
        check_digest(tid, algo, got, digest)
    except ChecksumError:
        rx.give_back(view, buf)
        raise
    return view, got, lambda reuse, b=buf: rx.pool.release(b, reuse)

