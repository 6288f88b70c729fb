"""Router: decides per request where it runs — a pure placement policy fed by heartbeats.

``place()`` is the policy (tests call it without a bus). ``sla`` (default): interactive → GPU
decode, standard and batch → CPU decode (each falling back to the other pool when its own is
empty); the least-loaded live worker of the pool wins. ``round-robin`` (the replicated
topology, TANDEM_ROUTER_POLICY): every live decode worker in turn, whatever its pool, the way a
plain load balancer in front of N replicas spreads requests. Prompts are prefilled on a prefill worker when one
is live (GPU prefill workers first: prefill is fastest there); without one the decode worker
runs the prompt itself. The full SLA policy (cache overlap, affinity, migration) builds on
this seam.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from shared import metrics, subjects, tracing
from shared.bus import Bus, BusError
from shared.schemas import Heartbeat, RoutePlan, RouteRequest
from shared.settings import Settings

log = logging.getLogger("tandem.router")

MAX_QUEUE = 256          # a worker with this many waiting requests takes no more (429 when all do)
LIVENESS_FACTOR = 3.0    # a worker is gone after this many missed heartbeat intervals

POOLS = {
    "interactive": (subjects.GPU_DECODE, subjects.CPU_DECODE),
    "standard": (subjects.CPU_DECODE, subjects.GPU_DECODE),
    "batch": (subjects.CPU_DECODE, subjects.GPU_DECODE),
}


POLICIES = ("sla", "round-robin")


@dataclass
class WorkerView:
    beat: Heartbeat
    seen: float  # router's clock when the last heartbeat arrived

    def alive(self, now: float) -> bool:
        return self.beat.ready and now - self.seen <= LIVENESS_FACTOR * self.beat.interval

    def load(self) -> tuple:
        b = self.beat
        return (b.queue_depth + b.running, -b.free_kv_blocks, b.worker_id)


def _open(pool: list[WorkerView], what: str) -> list[WorkerView]:
    open_ = [w for w in pool if w.beat.queue_depth < MAX_QUEUE]
    if not open_:
        raise BusError("overloaded", f"every {what} worker has a full queue; retry later")
    return open_


def place(req: RouteRequest, workers: list[WorkerView], now: float, policy: str = "sla",
          turn: int = 0) -> RoutePlan:
    """The plan for one request (``turn``: the round-robin counter, the caller's state). Raises
    BusError("unavailable") with no decode worker, BusError("overloaded") when every
    candidate's queue is full."""
    if policy not in POLICIES:
        raise ValueError(f"unknown router policy {policy!r} (one of {', '.join(POLICIES)})")
    live = [w for w in workers if w.alive(now)]
    need = req.num_prompt_tokens + 1
    decode = None
    if policy == "round-robin":
        pool = sorted((w for w in live if w.beat.role in (subjects.GPU_DECODE, subjects.CPU_DECODE)
                       and w.beat.max_context >= need), key=lambda w: w.beat.worker_id)
        if pool:
            open_ = _open(pool, "decode")
            decode = open_[turn % len(open_)]
            reason = f"round-robin -> {decode.beat.worker_id} (turn {turn} of {len(open_)})"
    else:
        for role in POOLS[req.tier]:
            pool = [w for w in live if w.beat.role == role and w.beat.max_context >= need]
            if pool:
                decode = min(_open(pool, role), key=WorkerView.load)
                break
        if decode is not None:
            first = POOLS[req.tier][0]
            reason = f"{req.tier} -> {decode.beat.role}" + (
                "" if decode.beat.role == first else f" ({first} pool empty)")
    if decode is None:
        raise BusError("unavailable", "no decode worker is ready")
    prefills = [w for w in live if w.beat.role == subjects.PREFILL and w.beat.max_context >= need
                and w.beat.queue_depth < MAX_QUEUE]
    prefill = None
    if prefills and decode.beat.data_port:
        prefill = min(prefills, key=lambda w: (not w.beat.device.startswith("cuda"), w.load()))
        reason += f"; prefill on {prefill.beat.worker_id} ({prefill.beat.device})"
    else:
        reason += "; decode worker prefills"
    return RoutePlan(request_id=req.request_id, prefill_worker=prefill.beat.worker_id if prefill else None,
                     decode_worker=decode.beat.worker_id, decode_role=decode.beat.role, reason=reason,
                     decode_data_host=decode.beat.data_host, decode_data_port=decode.beat.data_port)


class Router:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.worker_id = settings.worker.resolved_worker_id(subjects.ROUTER)
        self.workers: dict[str, WorkerView] = {}
        self.policy = settings.worker.router_policy
        self.turn = 0                                # round-robin counter
        self.metrics_port = 0
        self.bus: Bus | None = None

    async def start(self) -> None:
        tracing.setup(subjects.ROUTER)
        self.metrics_port = metrics.serve_http(self.settings.worker.metrics_port,
                                               self.settings.worker.metrics_host) or 0
        self.bus = await Bus.connect(self.settings, name=self.worker_id)
        self._beats = await self.bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, skip_invalid=True)
        self._beat_task = asyncio.create_task(self._watch(), name="heartbeats")
        await self.bus.serve(subjects.ROUTE, self.route, queue=subjects.ROUTE_QUEUE, expected=RouteRequest)
        self.bus.start_heartbeat(subjects.heartbeat(subjects.ROUTER, self.worker_id), self.heartbeat,
                                 self.settings.worker.heartbeat_interval)
        log.info("router %s ready (policy %s)", self.worker_id, self.policy)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(worker_id=self.worker_id, role=subjects.ROUTER, device="cpu", model="", ready=True,
                         queue_depth=0, running=0, free_kv_blocks=0, total_kv_blocks=0, max_context=0,
                         data_host="", data_port=0, ts=time.time(),
                         interval=self.settings.worker.heartbeat_interval, metrics_port=self.metrics_port)

    async def _watch(self) -> None:
        async for beat in self._beats:
            self.workers[beat.worker_id] = WorkerView(beat, time.monotonic())

    async def route(self, req: RouteRequest) -> RoutePlan:
        now = time.monotonic()
        self.workers = {k: w for k, w in self.workers.items() if w.alive(now) or now - w.seen < 60}
        plan = place(req, list(self.workers.values()), now, self.policy, self.turn)
        self.turn += 1
        metrics.ROUTES.labels(self.policy, plan.decode_role, "yes" if plan.prefill_worker else "no").inc()
        log.info("%s: %s", req.request_id, plan.reason)
        return plan

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        await stop.wait()
        self._beat_task.cancel()
        await self.bus.close()
