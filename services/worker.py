"""What every engine worker (prefill, gpu-decode, cpu-decode) shares: the engine, the bus
connection, heartbeats with load, aborts, and streaming outputs as ``StreamChunk`` messages.

Life cycle of a request in a worker: one ``Request`` record per request id, its ``State``:

    queued ─▶ running ─┬─▶ done           finished, or failed (an ``ErrorReply`` on the stream, never silence)
                       ├─▶ handing off ─▶ done        prefill: handed_to the decode worker
                       ├─▶ moving ─▶ held ─┬─▶ done   migration: handed_to the target
                       │                   └─▶ running    the move failed: it goes on here
                       └─▶ aborted        an Abort, a resume's fence, a lapsed lease (from any live state)

A record that is no longer live is remembered a while: an aborted one (``fence``: attempts below
it are refused, ABORTED_TTL) and a handed one (``handed_to``: Where replies, HANDED_TTL). The
engine ends a stream that is no answer with its own markers ("prefilled", "migrated", "abort");
they become states here (``ENDS``): a ``StreamChunk``'s ``finish_reason`` is OpenAI's.

Metrics (shared/metrics.py, on this process's own /metrics port, announced in heartbeats):
per tier, queue time = handler received → engine took the request, TTFT = received → first
output published, TPOT; engine load and KV blocks from each heartbeat. Heartbeats also list
the requests held (id, session, tier), waiting requests per tier and a moving average TPOT.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared import metrics, subjects, tracing
from shared.energy import EnergyMeter
from shared.bus import Bus, BusError
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, EngineConfig, EngineFull
from shared.engine.sampling import RequestOutput, SamplingParams
from shared.kv_connector import KVConnector
from shared.os_priority import BatchLane
from shared.tier import Tier
from shared.schemas import Abort, ErrorReply, Heartbeat, InFlight, Lease, LeaseReply, StreamChunk, Where, WhereReply
from shared.settings import Settings

log = logging.getLogger("tandem.worker")


def engine_config(settings: Settings, device: str, role: str = "") -> EngineConfig:
    """The engine of a worker on ``device``. Every stream in an engine waits for its step, and a
    CPU step of 512 prompt tokens takes seconds: CPU engines take 64-token steps while any
    sequence decodes, and while interactive work runs, worse tiers' prefill gets 8 tokens of a
    step (measured, 1 thread: a step with 32 prompt tokens 0.27-0.66 s, with decodes only
    ~25 ms). While nothing decodes no stream waits on a step: prompts then take 512-token steps
    (prefill throughput: docs/benchmarks.md, "Warm after a full restart"). On a gpu-decode worker
    (the interactive pool) standard and batch work are overflow guests: on the CPU their prefill
    runs 16 tokens a step, so an interactive arrival never waits behind a long step."""
    w = settings.worker
    cpu = not device.startswith("cuda")
    return EngineConfig(device=device, threads=w.threads or None, num_kv_blocks=w.kv_blocks or None,
                        kv_cache_bytes=w.kv_budget_mb_for(role) << 20, max_context=w.max_context or None,
                        max_num_seqs=w.max_seqs or EngineConfig.max_num_seqs,
                        step_tokens=w.step_tokens or max(64 if cpu else 512, w.max_seqs),
                        prefill_step_tokens=w.prefill_step_tokens or (512 if cpu else None),
                        shared_step_tokens=w.shared_step_tokens or (8 if cpu else 64),
                        guest_step_tokens=(w.guest_step_tokens or (16 if cpu else None))
                        if role == subjects.GPU_DECODE else None, max_waiting=w.max_waiting,
                        weight_cache_dir=w.weight_cache_dir, load_threads=w.load_threads or None,
                        gpu_step=w.gpu_step, session_retention_s=w.session_retention_s, fair_tenants=w.fair_tenants)


def batch_lane(settings: Settings, device) -> BatchLane | None:
    """The low-priority thread batch-only steps run on (TANDEM_OS_PRIORITY); None when off, or on
    CUDA (a GPU step's CPU side is a launch queue: nothing to yield). Logged once at start."""
    p = settings.priority
    if not p.enabled or device.type != "cpu":
        log.info("OS priority: every engine step at normal priority (%s)",
                 "TANDEM_OS_PRIORITY off" if not p.enabled else f"engine on {device}")
        return None
    lane = BatchLane(p.batch_nice, p.batch_sched)
    log.info("OS priority: %s; other steps at normal priority", lane.describe())
    return lane


def sampling_from(d: dict) -> SamplingParams:
    """Wire dict -> validated SamplingParams (ValueError names the bad field)."""
    return SamplingParams.from_dict(d).validate()


def priority_of(tier: str) -> int:
    return Tier.parse(tier).priority


@dataclass
class _Timing:
    tier: str            # the request's SLA tier
    received: float      # time.monotonic() when the handler got it


class State(enum.Enum):
    """Where a request is on this worker (module doc)."""
    QUEUED = "queued"            # the engine took it; its stream has not started
    RUNNING = "running"          # its stream publishes the engine's outputs
    HANDING_OFF = "handing off"  # prefill done: its KV goes to the decode worker (services/prefill.py)
    MOVING = "moving"            # a migration exports and sends it (services/decode.py); its stream may still run
    HELD = "held"                # its stream ended at the move's park: held here until the move ends
    ABORTED = "aborted"          # dropped here (an Abort, a resume's fence, a lapsed lease)
    DONE = "done"                # ended here, or handed to another worker (``handed_to``)


LIVE = frozenset({State.QUEUED, State.RUNNING, State.HANDING_OFF, State.MOVING, State.HELD})
# the engine's ends that are no answer to the client -> the state the request goes to here
ENDS = {"prefilled": State.HANDING_OFF, "migrated": State.MOVING, "abort": State.ABORTED}


@dataclass(eq=False)
class Request:
    """One request on this worker: its attempt's routing, its stream task, its state; once not
    live, what is remembered of it (a fence, where it went)."""
    request_id: str
    state: State = State.QUEUED
    attempt: int = 0             # its attempt (a resume after a lost worker starts a new one)
    tier: str = "standard"
    session_id: str = ""         # "" = none
    stream_subject: str = ""
    origin: str = ""             # the gateway waiting for it ("" = unknown: no lease)
    received: float = 0.0        # when the handler got it (queue time, TTFT); 0: taken by its stream
    task: asyncio.Task | None = None  # its stream
    fence: int = 0               # attempts below this were aborted (0: none)
    fenced_at: float = 0.0
    handed_to: str = ""          # the worker it was handed or moved to ("": none)
    handed_at: float = 0.0

    @property
    def live(self) -> bool:
        """Held here: in heartbeats and leases, ``Where`` says so."""
        return self.state in LIVE

    def timing(self) -> _Timing | None:
        """Its arrival, for the first stream only (a stream resumed after a failed move has none)."""
        if not self.received:
            return None
        t, self.received = _Timing(self.tier, self.received), 0.0
        return t


ENDED_S = 5.0            # seconds a heartbeat lists a request that left (Heartbeat.ended) ...
ENDED_MAX = 512          # ... at most this many, the newest
ABORTED_TTL = 300.0      # seconds an aborted request id is remembered (a move may still bring it)
HANDED_TTL = 120.0       # seconds a request handed to another worker is remembered (Where replies)
TPOT_ALPHA = 0.05        # weight of the newest inter-token interval in the TPOT moving average
class Aborted(Exception):
    """A request found aborted by another worker (a hand-off's receiver dropped its KV): it ends
    here as an abort — counted and logged so, no error reply (nobody waits for one)."""


ALL_ATTEMPTS = 1 << 62   # Abort.below_attempt 0: every attempt


class EngineWorker:
    role: str = ""
    writes_back = False   # finished sequences' KV goes back to the pool (decode)

    def __init__(self, settings: Settings, device: str):
        self.settings = settings
        self.worker_id = settings.worker.resolved_worker_id(self.role)
        engine = Engine.from_path(settings.worker.model, engine_config(settings, device, self.role))
        self.engine = AsyncEngine(engine, batch_lane(settings, engine.device))
        self.model_name = self.engine.model_name
        self.device = self.engine.device
        self.bus: Bus | None = None
        self.kv: KVConnector | None = None         # hand-off, migration, the KV pool, chunk events
        self.requests: dict[str, Request] = {}     # request id -> its record (live, or remembered a while)
        self.data_host, self.data_port = "", 0
        self.ring_port = 0                         # hosts ring members there (cpu-decode, services/decode.py)
        self.metrics_port = 0
        on_gpu = self.device.startswith("cuda")  # a GPU worker counts its GPUs (NVML), a CPU one RAPL
        self.energy = EnergyMeter(nvml=on_gpu, rapl=not on_gpu)
        self.tpot = 0.0                            # moving average seconds per output token
        self.heard: dict[str, float] = {}          # gateway id -> when it last answered a lease check
        self.admitting: dict[str, tuple[int, asyncio.Future]] = {}  # request id -> (attempt, done): the engine takes it
        self.arriving: dict[str, int] = {}         # request id -> the newest attempt being admitted (Where: held)
        self._lease_task: asyncio.Task | None = None
        # what the heartbeat says left lately: the held set of the last beat, the ids taken since,
        # and id -> when a beat first found it gone (listed for ENDED_S); an end wakes the beat
        self._beat_held: set[str] = set()
        self._taken: set[str] = set()
        self._ended: dict[str, float] = {}
        self._beat_wake = asyncio.Event()
        self.draining = False                      # stopping: no new work (heartbeats say so)

    async def start(self) -> None:
        tracing.setup(self.role)
        log.info("engine warmed up in %.0f ms (the first request does not pay for it)",
                 await self.engine.warm_up() * 1e3)
        self.metrics_port = metrics.serve_http(self.settings.worker.metrics_port,
                                               self.settings.worker.metrics_host) or 0
        self.bus = await Bus.connect(self.settings, name=self.worker_id, role=self.role)
        self.kv = KVConnector(self.settings, self.bus, self.engine, self.worker_id, self.role,
                              write_back=self.writes_back)
        await self.kv.start()
        # heartbeats advertise the receiver (hand-offs and migrations to decode workers, pool gets to
        # every worker): KV is only ever sent to an address a live worker's heartbeat names
        self.data_host, self.data_port = self.kv.data_host, self.kv.data_port
        self._abort_sub = await self.bus.subscribe(subjects.ABORT, Abort, skip_invalid=True)
        self._abort_task = asyncio.create_task(self._abort_loop(), name="abort-listener")
        await self.bus.serve(subjects.worker_where(self.worker_id), self.where, expected=Where)
        self._lease_task = asyncio.create_task(self._leases(), name="gateway-leases")
        await self.register()
        self.bus.start_heartbeat(subjects.heartbeat(self.role, self.worker_id), self.heartbeat,
                                 self.settings.worker.heartbeat_interval, wake=self._beat_wake)
        log.info("%s %s ready on %s (model %s)", self.role, self.worker_id, self.device, self.model_name)

    async def register(self) -> None:
        """Serve the role's subjects (subclasses)."""

    def heartbeat(self) -> Heartbeat:
        st = self.engine.stats()
        for domain, j in (self.energy.tick() or {}).items():
            metrics.ENERGY.labels(self.role, domain).inc(j)
        metrics.set_engine_load(self.role, queue_depth=st["waiting"] + st["queued_requests"], running=st["running"],
                                kv_used=st["total_kv_blocks"] - st["free_kv_blocks"], kv_free=st["free_kv_blocks"],
                                sessions_resident=st.get("sessions_resident", 0))
        ready = self.ready() and not self.draining
        metrics.set_ready(self.role, ready and self.bus.nc.is_connected)
        held = self.held
        return Heartbeat(worker_id=self.worker_id, role=self.role, device=self.device, model=self.model_name,
                         ready=ready, draining=self.draining, queue_depth=st["waiting"] + st["queued_requests"],
                         running=st["running"],
                         free_kv_blocks=st["free_kv_blocks"], total_kv_blocks=st["total_kv_blocks"],
                         max_context=self.engine.max_context, data_host=self.data_host,
                         data_port=self.data_port, ts=time.time(),
                         interval=self.settings.worker.heartbeat_interval, metrics_port=self.metrics_port,
                         requests=[InFlight(rid, r.session_id, r.tier) for rid, r in held.items()],
                         max_running=st.get("max_running", 0), ended=self.ended(held),
                         waiting_by_tier=self.waiting_by_tier(st), tpot_ms=round(self.tpot * 1e3, 3),
                         waiting_by_owner={o: {str(Tier.of_priority(p) or f"priority-{p}"): n for p, n in by.items()}
                                           for o, by in st.get("waiting_by_owner", {}).items()},
                         kv_scope=self.kv.scope.seed().hex(), chunk_tokens=self.kv.scope.chunk_tokens,
                         kv_block_tokens=self.engine.layout.block_size, ring_port=self.ring_port,
                         kv_tokens=st.get("kv_tokens", {}))

    def ended(self, held: dict) -> list[str]:
        """The requests that left this worker lately (finished, handed off, moved, aborted): each
        listed by the beats of ``ENDED_S`` seconds (two intervals, if longer) from the first that
        found it gone — the router stops counting it as soon as one arrives, a lost beat or two
        notwithstanding. The newest ``ENDED_MAX``."""
        now, keep = time.monotonic(), max(ENDED_S, 2 * self.settings.worker.heartbeat_interval)
        for rid in (self._beat_held | self._taken) - held.keys():
            self._ended.setdefault(rid, now)
        self._beat_held, self._taken = set(held), set()
        for rid, t in list(self._ended.items()):
            if now - t > keep or rid in held:
                del self._ended[rid]
        return list(self._ended)[-ENDED_MAX:]

    @staticmethod
    def waiting_by_tier(st: dict) -> dict:
        out = {str(t): 0 for t in Tier}
        for prio, n in st.get("waiting_by_priority", {}).items():
            tier = str(Tier.of_priority(prio) or f"priority-{prio}")
            out[tier] = out.get(tier, 0) + n
        return out

    def ready(self) -> bool:
        """The engine is not stuck in a step (TANDEM_STEP_DEADLINE_S): it makes progress on what it
        holds (Where replies) and, unless draining, takes work (heartbeats)."""
        return not self.engine.stalled(self.settings.worker.step_deadline_s)

    def refuse_if_draining(self, code: str, what: str) -> None:
        """A stopping worker takes no new work: ``what`` is refused with ``code``, which sends it
        elsewhere — not_found for a request from a gateway (it routes it again without this
        worker), overloaded for a hand-off (the sender's gateway routes it again, no loss counted,
        without this worker: the refusal names it, ``lost``)."""
        if self.draining:
            raise BusError(code, f"{self.worker_id} is stopping (draining): {what} goes to another worker",
                           lost=self.worker_id)

    # ---- views of the records ----------------------------------------------------------
    @property
    def held(self) -> dict[str, Request]:
        """The requests held here (live), by id."""
        return {rid: r for rid, r in self.requests.items() if r.live}

    @property
    def tasks(self) -> dict[str, asyncio.Task]:
        """The stream tasks running, by request id."""
        return {rid: r.task for rid, r in self.requests.items() if r.task is not None}

    @property
    def moving(self) -> set[str]:
        """The requests a migration is moving away."""
        return {rid for rid, r in self.requests.items() if r.state in (State.MOVING, State.HELD)}

    def _prune(self, now: float) -> None:
        """Forget fences and hand-overs past their time; records with nothing left to say go."""
        for rid, r in list(self.requests.items()):
            if r.fence and now - r.fenced_at >= ABORTED_TTL:
                r.fence = 0
            if r.handed_to and now - r.handed_at >= HANDED_TTL:
                r.handed_to = ""
            if not r.live and not r.fence and not r.handed_to and r.task is None:
                del self.requests[rid]

    # ---- where a request is, who still wants it ----------------------------------------
    async def where(self, req: Where) -> WhereReply:
        """Does this worker hold the request (or where did it send it)? The gateway asks when a
        stream goes quiet; no responders tells it this worker is gone. A request being moved is
        still held here until the target has it (a failed move goes on here): a quiet stream
        during a slow move is not a lost one."""
        rec = self.requests.get(req.request_id)
        held = rec if rec is not None and rec.live else None
        arriving = self.arriving.get(req.request_id)
        if arriving is not None and (held is None or arriving > held.attempt):
            # being admitted (behind a long engine step, say): not a lost one
            return WhereReply(worker=self.worker_id, holds=True, ready=self.ready(), attempt=arriving)
        return WhereReply(worker=self.worker_id, holds=held is not None,
                          handed_to=rec.handed_to if rec is not None and held is None else "", ready=self.ready(),
                          attempt=held.attempt if held else 0)

    def hand_over(self, request_id: str, worker: str) -> None:
        """``request_id`` now runs on ``worker`` (hand-off or migration): Where replies say so."""
        now = time.monotonic()
        self._prune(now)
        rec = self.requests.setdefault(request_id, Request(request_id, State.DONE))
        rec.handed_to, rec.handed_at = worker, now

    async def _leases(self) -> None:
        """Every heartbeat interval, ask each gateway whose requests this worker holds which of
        them it still waits for (``Lease`` -> ``LeaseReply``): what it let go (finished, failed, its
        client gone: an Abort lost in a bus outage) and attempts it has replaced are dropped. No
        responders means the gateway is gone only when it has answered since this worker's own
        connection last came back: after a bus outage (a restarted nats-server) every client
        reconnects in its own time, and a gateway not back yet is not a dead one, however long it
        takes. A timeout proves nothing either. A dead gateway's requests are dropped (KV freed)."""
        interval = max(0.5, self.settings.worker.heartbeat_interval)
        while True:
            await asyncio.sleep(interval)
            origins = {r.origin for r in self.held.values() if r.origin}
            for origin in origins:
                try:
                    await self._lease(origin, interval)
                except Exception:
                    log.exception("lease check of gateway %s failed", origin)

    async def _lease(self, origin: str, interval: float) -> None:
        mine = {rid: r.attempt for rid, r in self.held.items() if r.origin == origin}
        try:
            reply = await self.bus.request(subjects.gateway_alive(origin), Lease(worker=self.worker_id, requests=mine),
                                           timeout=interval, expected=LeaseReply)
        except BusError as e:
            heard = self.heard.get(origin)
            since = self.bus.connected_since
            if e.code != "unavailable" or since is None or heard is None or heard < since:
                return  # busy, a blip, or not back since the outage: not proof it is gone
            log.warning("gateway %s is gone: dropping its %d request(s)", origin, len(mine))
            self.heard.pop(origin, None)
            lapsed = mine
        else:
            self.heard[origin] = time.monotonic()
            lapsed = {rid: a for rid, a in mine.items() if reply.attempts.get(rid, a + 1) > a}
            if lapsed:
                log.info("gateway %s let go of %d request(s) here: %s", origin, len(lapsed), sorted(lapsed))
        for rid, attempt in lapsed.items():  # only the attempt judged: a newer one admitted meanwhile stays
            await self._on_abort(Abort(request_id=rid, reason=f"lease of gateway {origin} lapsed",
                                       below_attempt=attempt + 1))

    def is_aborted(self, request_id: str, attempt: int) -> bool:
        rec = self.requests.get(request_id)
        return rec is not None and attempt < rec.fence

    async def _abort_loop(self) -> None:
        async for msg in self._abort_sub:
            await self._on_abort(msg)

    async def _on_abort(self, msg: Abort) -> None:
        """Drop the request (all attempts, or those below ``msg.below_attempt``: a resume fences them)."""
        now = time.monotonic()
        self._prune(now)
        below = msg.below_attempt or ALL_ATTEMPTS
        if self.kv is not None:   # KV on its way here for it, whose DecodeRequest may never come
            for tid in self.kv.discard_request(msg.request_id, msg.below_attempt or None):
                log.info("%s: KV transfer %s discarded (aborted)", msg.request_id, tid)
        rec = self.requests.setdefault(msg.request_id, Request(msg.request_id, State.ABORTED))
        rec.fence, rec.fenced_at = max(below, rec.fence), now   # remembered: a move may still bring it
        held = rec if rec.live else None
        if held is not None and held.attempt >= below:
            return  # a newer attempt runs here: the abort fences older ones only
        if held is None and msg.below_attempt:
            # a fence, and no older attempt here. The engine knows requests by id only: aborting
            # there would end the newer attempt whose admission may be under way on this worker
            # (an older one still being admitted finds itself in ``aborted`` when it is taken).
            return
        task, rec.task = rec.task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=5)  # its stream is closed before a new attempt opens one
        # (the stream's end ended the record already, or not yet: either way the engine drops it now,
        # before a resume waiting on this can add its own sequence under the same id)
        now_rec, pending = self.requests.get(msg.request_id), self.admitting.get(msg.request_id)
        if (now_rec is not rec and now_rec is not None and now_rec.live) or (pending is not None and pending[0] >= below):
            return  # a newer attempt was admitted, or is being admitted, meanwhile: it stays
        if await self.engine.abort(msg.request_id):
            log.info("%s aborted (%s)", msg.request_id, msg.reason or "client gone")
        rec.state = State.ABORTED   # (its stream's end may have called it done first)

    def spawn(self, request_id: str, coro) -> None:
        """Run the request's stream (``stream_outputs``) as its task: queued -> running."""
        rec = self.requests[request_id]
        rec.task = asyncio.create_task(coro, name=f"stream-{request_id}")
        if rec.state is State.QUEUED:
            rec.state = State.RUNNING
        rec.task.add_done_callback(lambda t, r=rec: self._stream_done(r, t))

    def hold(self, rec: Request) -> None:
        """``rec`` (an attempt the engine took) becomes its request's record: the fence of older
        attempts stays; where an older attempt went is no news now."""
        prev = self.requests.get(rec.request_id)
        if prev is not None:
            rec.fence, rec.fenced_at = prev.fence, prev.fenced_at
        self.requests[rec.request_id] = rec
        self._taken.add(rec.request_id)

    def _stream_done(self, rec: Request, task: asyncio.Task) -> None:
        """Its stream ended: running / handing off -> done; moving -> held (the move decides)."""
        if rec.task is task:
            rec.task = None
        if rec.task is not None:
            return
        if rec.state is State.MOVING:
            rec.state = State.HELD
        elif rec.state in (State.QUEUED, State.RUNNING, State.HANDING_OFF):
            rec.state = State.DONE
            if not rec.fence and not rec.handed_to and self.requests.get(rec.request_id) is rec:
                del self.requests[rec.request_id]   # nothing to remember
        if not rec.live:
            self._beat_wake.set()                   # the router's count of it goes with the next beat

    async def stream_outputs(self, request_id: str, subject: str, outputs: AsyncIterator[RequestOutput],
                             first_seq: int, on_parked=None, attempt: int = 0, offset: int = 0) -> int | None:
        """Publish each output as a StreamChunk; the last one carries finish_reason and usage. An
        output carries every token made since the previous one was taken (one message for them);
        batch-tier streams may wait ``TANDEM_BATCH_COALESCE_MS`` between chunks to make that more.
        ``offset``: output tokens of the request before this stream's first (each chunk says where
        it starts: StreamChunk.offset). ``on_parked`` is awaited with the output that ends a
        prefill-only request. A request migrated away ends without a chunk: the seq the next
        worker starts at is returned. A request the engine dropped ("abort") ends without one too:
        an abort is never an answer (whoever dropped it either is the gateway, or a fence of an
        attempt the gateway has replaced, or a lease the gateway let go: nobody waits for it)."""
        seq = first_seq
        rec = self.requests.get(request_id)
        timing = rec.timing() if rec is not None else None
        coalesce = self.settings.worker.batch_coalesce_ms / 1e3 if rec and rec.tier == Tier.BATCH else 0.0
        first_at, emitted = None, 0     # this worker's first token, tokens it published
        last_at = None                  # when the previous output with tokens came
        try:
            async for out in outputs:
                if out.token_ids:
                    now = time.monotonic()
                    if last_at is not None:
                        dt = (now - last_at) / len(out.token_ids)
                        self.tpot = self.tpot + TPOT_ALPHA * (dt - self.tpot) if self.tpot else dt
                    if first_at is None:
                        first_at = now
                    last_at = now
                emitted += len(out.token_ids)
                end = ENDS.get(out.finish_reason)   # None: an answer (a token, OpenAI's finish reason)
                if end is State.MOVING:             # parked for a move: the target goes on from ``seq``
                    self._observe(timing, first_at, emitted, "migrated")
                    return seq
                if out.reused_tokens >= 0:
                    metrics.resumed(self.role, out.reused_tokens, out.recomputed_tokens)
                    log.info("%s resumed (attempt %d): %d token(s) of KV reused, %d recomputed", request_id,
                             attempt, out.reused_tokens, out.recomputed_tokens)
                if end is State.ABORTED:            # the engine dropped it: nobody waits for an answer
                    self._observe(timing, first_at, emitted, "aborted")
                    if rec is not None and rec.live:
                        rec.state = State.ABORTED
                    return
                if end is State.HANDING_OFF:        # prefill done: the first token, then the hand-off
                    await self.bus.publish(subject, self.chunk(out, seq, finish=False, attempt=attempt, offset=offset))
                    if rec is not None and rec.state is State.RUNNING:
                        rec.state = State.HANDING_OFF
                    await on_parked(out)
                    self._observe(timing, first_at, emitted, "parked")
                    return
                await self.bus.publish(subject, self.chunk(out, seq, finish=out.finished, attempt=attempt,
                                                           offset=offset))
                seq += 1
                offset += len(out.token_ids)
                if out.finished:
                    self._observe(timing, first_at, emitted, "ok")
                elif coalesce:  # the outputs of the steps meanwhile come merged (AsyncEngine._drain)
                    await asyncio.sleep(coalesce)
        except asyncio.CancelledError:  # aborted (client gone, a fence) or the worker stopping
            self._observe(timing, first_at, emitted, "aborted")
            raise
        except Aborted as e:            # found aborted elsewhere (the hand-off's receiver dropped it)
            self._observe(timing, first_at, emitted, "aborted")
            log.info("%s", e)
            await self.engine.abort(request_id)
            if rec is not None and rec.live:
                rec.state = State.ABORTED
        except Exception as e:  # the client hears about it, the worker goes on
            self._observe(timing, first_at, emitted, "error")
            if getattr(e, "code", "") in ("unavailable", "overloaded"):
                # a hand-off (or a ring member) that found its peer gone or full: the gateway goes on
                # elsewhere, no bug here
                log.warning("%s: %s", request_id, e)
            else:
                log.exception("%s failed", request_id)
            await self.engine.abort(request_id)
            code = "overloaded" if isinstance(e, EngineFull) else getattr(e, "code", "internal")
            try:
                reply = ErrorReply.of(code, f"{self.role} {self.worker_id}: {e}", request_id)
                reply.attempt, reply.lost = attempt, getattr(e, "lost", "")
                reply.sender_ok = getattr(e, "sender_ok", False)
                await self.bus.publish(subject, reply)
            except Exception:  # the bus is gone too: the gateway finds the request gone (Where) and resumes it
                log.warning("%s: could not publish the error", request_id)
        finally:
            # close the engine stream now, inside this task, even when it was cancelled between two
            # outputs (publishing, or a batch stream's coalescing sleep): a stream left to the
            # garbage collector aborted the request by id later, after a resume had re-admitted it
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                await aclose()

    def chunk(self, out: RequestOutput, seq: int, finish: bool, attempt: int = 0, offset: int = -1) -> StreamChunk:
        lps = None
        if out.logprobs is not None:
            lps = [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                   for lp in out.logprobs]
        usage = None
        if finish:
            usage = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
                     "cached_tokens": out.num_cached_tokens}
        return StreamChunk(request_id=out.request_id, seq=seq, token_ids=out.token_ids, text=out.text,
                           worker=self.worker_id, logprobs=lps,
                           finish_reason=out.finish_reason if finish else None, usage=usage, attempt=attempt,
                           reused_tokens=out.reused_tokens, recomputed_tokens=out.recomputed_tokens, offset=offset)

    def _observe(self, timing: _Timing | None, first_at: float | None, emitted: int, outcome: str) -> None:
        """Per-tier metrics of a request that ended here: finished (ok / aborted), handed on
        after prefill (parked), or failed (error). Tokens and TPOT count this worker's own."""
        if timing is None:
            return
        ttft = first_at - timing.received if first_at is not None else None
        tpot = (time.monotonic() - first_at) / (emitted - 1) if first_at is not None and emitted > 1 else None
        metrics.observe_request(self.role, timing.tier, ttft=ttft, tpot=tpot, tokens=emitted, outcome=outcome)
        log.info("%s %s: %d token(s), ttft %s", self.role, outcome, emitted,
                 f"{ttft:.3f}s" if ttft is not None else "-")

    async def admit(self, req, coro, attempt: int = 0):
        """Run the engine admission of ``req`` (a message with request_id, tier, stream subject,
        session and origin); engine errors become coded bus errors for the requester. Records the
        request's queue time. An older attempt of the same request still here is dropped first;
        an Abort that came before the engine took it ends it at once. Admissions of one request
        id run one at a time: a resume that comes while an older attempt is still being admitted
        here (its dispatch unanswered in time, so the gateway went on) waits for it, then drops it
        (the engine knows requests by id: the two would collide); an older attempt that comes
        after a newer one is refused."""
        rid = req.request_id
        self.arriving[rid] = max(attempt, self.arriving.get(rid, -1))
        try:
            return await self._admit(req, coro, attempt)
        finally:
            if self.arriving.get(rid) == attempt:
                del self.arriving[rid]

    async def _admit(self, req, coro, attempt: int):
        rid = req.request_id
        while (pending := self.admitting.get(rid)) is not None:
            await asyncio.shield(pending[1])
        if self.is_aborted(rid, attempt):
            coro.close()
            raise BusError("not_found", f"request {rid} was aborted")
        old = self.held.get(rid)
        if old is not None and old.attempt > attempt:
            coro.close()
            raise BusError("not_found", f"request {rid} runs here as attempt {old.attempt}, after {attempt}")
        if old is not None and old.attempt < attempt:
            await self._on_abort(Abort(request_id=rid, reason="superseded by a resume", below_attempt=attempt))
        if req.session_id:  # its KV stays resident between turns (shared/engine/retention.py)
            try:
                self.engine.tag_session(rid, req.session_id, getattr(req, "cache_retention", ""))
            except ValueError as e:
                coro.close()
                raise BusError("bad_request", str(e)) from None
        received = time.monotonic()
        done = asyncio.get_running_loop().create_future()
        self.admitting[rid] = (attempt, done)
        try:
            out = await coro
        except EngineFull as e:
            metrics.observe_request(self.role, req.tier, outcome="error")
            raise BusError("overloaded", str(e)) from None
        finally:
            del self.admitting[rid]
            done.set_result(None)
        metrics.observe_request(self.role, req.tier, queue=time.monotonic() - received)
        self.hold(Request(rid, State.QUEUED, attempt, req.tier, req.session_id or "", req.stream_subject,
                          req.origin, received))
        if self.is_aborted(rid, attempt):  # the Abort came while the engine took it
            await self.engine.abort(rid)
        return out

    async def run_until(self, stop: asyncio.Event) -> None:
        """Started: serve until ``stop`` is set (SIGTERM), then drain and close. Draining: a
        heartbeat at once says so (not ready, ``draining``), so no router sends work here and the
        router moves the decodes held here to other workers (migration: their streams go on
        there, unbroken); new work that still arrives is refused to go elsewhere; what is left
        finishes here, for up to TANDEM_DRAIN_S seconds. Then what still runs is cut (the gateways
        resume it elsewhere)."""
        await stop.wait()
        self.draining = True
        t0 = time.monotonic()
        try:   # at once (a woken beat waits out its 0.2 s gap): routers place by the last beat
            await self.bus.publish(subjects.heartbeat(self.role, self.worker_id), self.heartbeat())
        except Exception as e:   # the bus is down: the next beat says it
            log.warning("could not say %s is stopping: %s", self.worker_id, e)
            self._beat_wake.set()
        hosted = self._hosting()
        log.info("%s %s draining: %d request(s) held%s, no new work; the router moves decodes to other workers",
                 self.role, self.worker_id, len(self.held),
                 f", ring shards of {hosted} request(s) of other workers" if hosted else "")
        while self._busy() and time.monotonic() - t0 < self.settings.gateway.drain_s:
            await asyncio.sleep(0.05)
        left = len(self.held)
        log.info("%s %s drained in %.1f s%s", self.role, self.worker_id, time.monotonic() - t0,
                 f": {left} request(s) still held are cut (their gateways resume them)" if left else "")
        await self.close()

    def _busy(self) -> bool:
        """Holds a request (running, being admitted or moving away), or ring shards of other
        workers' requests: those rings go on to their ends (no new ring takes a member whose
        heartbeat says it is stopping)."""
        return bool(self.tasks or self.admitting or self.moving or self._hosting())

    def _hosting(self) -> int:
        """Ring shards held here for other workers' requests (a cpu-decode worker's ring member)."""
        ring = getattr(self, "ring", None)
        return ring.hosting() if ring is not None else 0

    async def close(self) -> None:
        for t in list(self.tasks.values()):
            t.cancel()
        self._abort_task.cancel()
        if self._lease_task is not None:
            self._lease_task.cancel()
        if self.kv is not None:
            await self.kv.close()
        if self.bus is not None:
            await self.bus.close()
        await self.engine.close()
