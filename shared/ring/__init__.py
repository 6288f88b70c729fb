"""Ring decode (the ``cpu-ring(N)`` strategy, docs/strategies.md): one session's KV split by
token ranges over N cpu-decode workers; each step the queries travel, the KV stays.

Life cycle of a ring session, and where each step lives:

    1. Plan        the router picks the members (services/placement.py → ``RoutePlan.ring``, a
                   list of ``RingPeer``); ``connector.ring_ranges`` / ``shard_ranges``
                   (shared/strategy.py) give each member a SEG-aligned token range over the
                   session's whole length (prompt + max new tokens), the last open to growth.
    2. Scatter /   the prefill worker (``RingConnector.scatter``) opens a connection per member
       park        but the coordinator, ``RESERVE``s and ``LOAD``s each range at once, and
                   ``PARK``s each shard under a fresh claim ticket (``RingClaim``); the
                   coordinator's own range travels in the hand-off blob. A session spread from
                   a running worker is scattered by its coordinator instead (``Ring.admit``).
    3. Claim       the coordinator (the decode worker the plan names first,
                   ``RingConnector.coordinate``) checks every member's address against live
                   heartbeats, ``CLAIM``s each parked shard with the ticket (each must hold the
                   range it plans) and loads its own (``connector.admit_claimed``).
    4. Decode      each engine step runs one ``Ring.step``: per layer q|k|v → the member owning
       steps       the new position stores k, v → every member with keys attends its segments
                   (``ATTEND``) → the coordinator merges, o-proj, FFN; sampled like any sequence.
    5. Fold        with ``fold`` the members fold their states along the ring themselves
                   (``CHAIN``, ``PEER``, ``STEP``, ``STATE``: server.py), head group by group.
    6. Gather      ``Ring.gather``: the shards' bytes end to end = the session's KV (layout v1),
                   what a move of the session to one worker carries.
    7. Release     ``Ring.release`` frees every shard (the last member first); a member's
                   connection closing frees what it held; a parked shard not claimed within the
                   data-plane timeout is freed.
    8. Faults      a member that stops answering raises ``RingMemberLost`` naming it; no room
                   ``RingCapacityError``; a refusal ``RingMemberError``. ``connector.bus_error``
                   is the one mapping to the bus's codes (unavailable: the gateway resumes the
                   request without the lost worker; overloaded; bad_request).

Modules: ``session`` (``Ring``, the ``RingMember`` Protocol, ``LocalMember``), ``wire`` (ops,
typed metadata, the authenticated channel, same-host regions), ``remote`` (``RemoteMember``),
``server`` (``RingServer``, ``EngineMember``, the fold), ``connector`` (``RingConnector``: what
services/prefill.py and services/decode.py call). Ring traffic is in the Prometheus metrics
(``tandem_ring_bytes``, ``tandem_ring_steps``, ``tandem_ring_sessions``).
"""

from shared.ring.connector import (
    RING_ERRORS, RingConnector, admit_claimed, bus_error, new_ticket, ring_ranges, scatter_parked,
)
from shared.ring.remote import RemoteMember, connect_ring
from shared.ring.server import EngineMember, RingServer
from shared.ring.session import LocalMember, Ring, RingCapacityError, RingMember, StepTimes, shard_bytes
from shared.ring.wire import RingMemberError, RingMemberLost

__all__ = [
    "RING_ERRORS", "EngineMember", "LocalMember", "RemoteMember", "Ring", "RingCapacityError", "RingConnector",
    "RingMember", "RingMemberError", "RingMemberLost", "RingServer", "StepTimes", "admit_claimed", "bus_error",
    "connect_ring", "new_ticket", "ring_ranges", "scatter_parked", "shard_bytes",
]
