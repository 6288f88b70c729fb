"""Every NATS subject Tandem uses, built in one place (see docs/protocol.md).

Request life cycle on the bus (two-phase, as in disaggregated serving):

1. gateway  --request-->  ``tandem.router.route``            (queue group ``router``) -> RoutePlan
2. gateway  --request-->  ``tandem.worker.<id>.prefill``     -> Ack; the prefill worker then sends
   the KV over the data plane and requests ``tandem.worker.<decode id>.decode`` with the handle
   (or, when the plan has no prefill worker, ``tandem.worker.<id>.generate``)
3. decode worker --publish--> ``tandem.stream.<request_id>``  StreamChunk ... final chunk
4. anyone   --publish-->  ``tandem.abort``                    Abort: every holder drops the request
5. every worker --publish--> ``tandem.heartbeat.<role>.<id>`` Heartbeat (load, readiness)

Ids that become subject tokens are validated: no empty string, whitespace, ``.``, ``*`` or ``>``.
"""

from __future__ import annotations

import re

PREFIX = "tandem"

# Roles a service can play; heartbeats are published per role.
GATEWAY = "gateway"
ROUTER = "router"
PREFILL = "prefill"
GPU_DECODE = "gpu-decode"
CPU_DECODE = "cpu-decode"
KVPOOL = "kvpool"
ROLES: tuple[str, ...] = (GATEWAY, ROUTER, PREFILL, GPU_DECODE, CPU_DECODE, KVPOOL)
DECODE_ROLES: tuple[str, ...] = (GPU_DECODE, CPU_DECODE)

# Fixed subjects.
ROUTE = f"{PREFIX}.router.route"          # request/reply: RouteRequest -> RoutePlan
ROUTE_QUEUE = "router"                    # queue group: router copies share route requests
ROUTER_DECISION = f"{PREFIX}.router.decision"  # every RoutePlan made (router copies sync sessions)
ROUTER_SESSION = f"{PREFIX}.router.session"    # request/reply, queue group: SessionUpdate -> SessionState
ABORT = f"{PREFIX}.abort"                 # broadcast Abort{request_id}
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.>"   # watch every heartbeat
TRANSFER_ALL = f"{PREFIX}.transfer.>"     # watch every KV transfer event
KV_EVENTS_ALL = f"{PREFIX}.kvevents.>"    # every KVEvent (chunks a holder stored / evicted)
ALL = f"{PREFIX}.>"                       # everything (tandem tap's default)

# A subject token: printable, no whitespace, no '.', '*' or '>' (NATS separators / wildcards).
_TOKEN = re.compile(r"^[^\s.*>]+$")


def check_token(value: str, what: str = "id") -> str:
    """Return ``value`` if it is usable as one subject token, else raise ValueError naming it."""
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise ValueError(f"invalid {what} {value!r}: must be non-empty with no whitespace, '.', '*' or '>'")
    return value


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"invalid role {role!r}: expected one of {', '.join(ROLES)}")
    return role


def worker_prefill(worker_id: str) -> str:
    """Directed request to one prefill worker: PrefillRequest -> Ack | ErrorReply."""
    return f"{PREFIX}.worker.{check_token(worker_id, 'worker_id')}.prefill"


def worker_decode(worker_id: str) -> str:
    """Directed request to one decode worker: DecodeRequest (imports a KV handle) -> Ack | ErrorReply."""
    return f"{PREFIX}.worker.{check_token(worker_id, 'worker_id')}.decode"


def worker_generate(worker_id: str) -> str:
    """Directed request to one decode worker that does its own prefill: GenerateRequest -> Ack."""
    return f"{PREFIX}.worker.{check_token(worker_id, 'worker_id')}.generate"


def worker_migrate(worker_id: str) -> str:
    """Directed request to one decode worker: MigrateRequest -> MigrateReply | ErrorReply."""
    return f"{PREFIX}.worker.{check_token(worker_id, 'worker_id')}.migrate"


def worker_where(worker_id: str) -> str:
    """Directed request to one engine worker: Where -> WhereReply. No responders: the worker is
    gone (how a gateway learns, within a round trip, that a request's holder died)."""
    return f"{PREFIX}.worker.{check_token(worker_id, 'worker_id')}.where"


def gateway_alive(gateway_id: str) -> str:
    """Directed request to one gateway copy: Lease -> LeaseReply (the attempts it still waits
    for). Workers ask it for the requests they hold of it (their lease; services/worker.py)."""
    return f"{PREFIX}.gateway.{check_token(gateway_id, 'gateway_id')}.alive"


def stream(request_id: str) -> str:
    """Token stream of one request (worker -> gateway): StreamChunk in seq order, or ErrorReply."""
    return f"{PREFIX}.stream.{check_token(request_id, 'request_id')}"


def heartbeat(role: str, worker_id: str) -> str:
    """Periodic Heartbeat of one worker."""
    return f"{PREFIX}.heartbeat.{check_role(role)}.{check_token(worker_id, 'worker_id')}"


def heartbeat_role(role: str) -> str:
    """Wildcard: every heartbeat of one role."""
    return f"{PREFIX}.heartbeat.{check_role(role)}.*"


POOL_LOOKUP = f"{PREFIX}.kvpool.lookup"   # request/reply, queue group: PoolLookup -> PoolLookupReply
POOL_QUEUE = "kvpool"                     # queue group of the pool copies


def kvpool_get(pool_id: str) -> str:
    """Directed request to one pool copy: PoolGet -> PoolGetReply (bytes on the data plane)."""
    return f"{PREFIX}.kvpool.{check_token(pool_id, 'pool_id')}.get"


def kvpool_put(pool_id: str) -> str:
    """Directed request to one pool copy: PoolPut -> PoolPutReply (bytes sent before)."""
    return f"{PREFIX}.kvpool.{check_token(pool_id, 'pool_id')}.put"


def kv_events(holder: str) -> str:
    """KVEvent published by one KV holder (a worker's prefix cache or a pool copy)."""
    return f"{PREFIX}.kvevents.{check_token(holder, 'holder')}"


def transfer(worker_id: str) -> str:
    """TransferEvent published by the worker that sent (or received) KV bytes."""
    return f"{PREFIX}.transfer.{check_token(worker_id, 'worker_id')}"
