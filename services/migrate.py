"""Ask a decode worker to move one of its running requests to another decode worker.

The worker parks the request at a decode-step boundary, sends its KV and sampler state over
the data plane to the target, and the target continues the same stream at the next seq
(services/decode.py ``handle_migrate``; docs/architecture.md, Migration). The router decides
when and where; this is the call it makes.
"""

from __future__ import annotations

from shared import subjects
from shared.bus import Bus
from shared.schemas import Heartbeat, MigrateReply, MigrateRequest, RingPeer


async def migrate(bus: Bus, source_worker: str, req: MigrateRequest, timeout: float = 30.0) -> MigrateReply:
    """Move ``req.request_id`` from ``source_worker`` to ``req.target_worker``.

    Raises RemoteError with the worker's code: not_found (not there), unavailable (not
    decoding yet or already moving: retry; or the target was unreachable), overloaded (the
    target refused it), timeout. After any error the request goes on at the source."""
    return await bus.request(subjects.worker_migrate(source_worker), req, timeout=timeout, expected=MigrateReply)


def to_target(request_id: str, target: Heartbeat, tier: str, reason: str = "",
              ring: list[Heartbeat] = ()) -> MigrateRequest:
    """A MigrateRequest moving ``request_id`` to the worker whose heartbeat is ``target``; with
    ``ring`` (cpu-decode workers' heartbeats in shard order, ``target`` first), spreading it onto
    that ring (docs/strategies.md)."""
    return MigrateRequest(request_id=request_id, target_worker=target.worker_id, target_data_host=target.data_host,
                          target_data_port=target.data_port, tier=tier, reason=reason,
                          ring=[RingPeer(b.worker_id, b.data_host, b.ring_port) for b in ring])
