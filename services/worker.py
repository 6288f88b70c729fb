"""What every engine worker (prefill, gpu-decode, cpu-decode) shares: the engine, the bus
connection, heartbeats with load, aborts, and streaming outputs as ``StreamChunk`` messages.

Life cycle of a request in a worker: Accepted (the engine took it; the handler acks) →
Streaming (a task publishes each output on the request's stream subject) → Done (finished,
aborted, or failed: a failure is published on the stream as an ``ErrorReply``, never silence).

Metrics (shared/metrics.py, on this process's own /metrics port, announced in heartbeats):
per tier, queue time = handler received → engine took the request, TTFT = received → first
output published, TPOT; engine load and KV blocks from each heartbeat. Heartbeats also list
the requests held (id, session, tier), waiting requests per tier and a moving average TPOT.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared import metrics, subjects, tracing
from shared.energy import EnergyMeter
from shared.bus import Bus, BusError
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, EngineConfig, EngineFull
from shared.engine.sampling import TIER_PRIORITY, RequestOutput, SamplingParams
from shared.schemas import Abort, ErrorReply, Heartbeat, StreamChunk
from shared.settings import Settings
from services.kvpool import KVEventPublisher, key_scope, publish_chunk_events

log = logging.getLogger("tandem.worker")


def engine_config(settings: Settings, device: str, role: str = "") -> EngineConfig:
    """The engine of a worker on ``device``. Every stream in an engine waits for its step, and a
    CPU step of 512 prompt tokens takes seconds: CPU engines take 64-token steps, and while
    interactive work runs, worse tiers' prefill gets 8 tokens of a step (measured, 1 thread:
    a step with 32 prompt tokens 0.27-0.66 s, with decodes only ~25 ms). On a gpu-decode worker
    (the interactive pool) standard and batch work are overflow guests: on the CPU their prefill
    runs 16 tokens a step, so an interactive arrival never waits behind a long step."""
    w = settings.worker
    cpu = not device.startswith("cuda")
    return EngineConfig(device=device, threads=w.threads or None, num_kv_blocks=w.kv_blocks or None,
                        kv_cache_bytes=w.kv_budget_mb << 20, max_context=w.max_context or None,
                        max_num_batched_tokens=w.step_tokens or (64 if cpu else 512),
                        interactive_step_tokens=w.shared_step_tokens or (8 if cpu else 64),
                        worse_step_tokens=(w.guest_step_tokens or (16 if cpu else None))
                        if role == subjects.GPU_DECODE else None)


def sampling_from(d: dict) -> SamplingParams:
    """Wire dict -> validated SamplingParams (ValueError names the bad field)."""
    return SamplingParams.from_dict(d).validate()


def priority_of(tier: str) -> int:
    if tier not in TIER_PRIORITY:
        raise ValueError(f"unknown tier {tier!r}")
    return TIER_PRIORITY[tier]


@dataclass
class _Timing:
    tier: str            # the request's SLA tier
    received: float      # time.monotonic() when the handler got it


@dataclass
class Held:
    """A request in flight on this worker (heartbeat ``requests``; a migration reuses it)."""
    session_id: str      # "" = none
    tier: str
    stream_subject: str


TIER_OF_PRIORITY = {p: t for t, p in TIER_PRIORITY.items()}
ABORTED_TTL = 300.0      # seconds an aborted request id is remembered (a move may still bring it)
TPOT_ALPHA = 0.05        # weight of the newest inter-token interval in the TPOT moving average


class EngineWorker:
    role: str = ""

    def __init__(self, settings: Settings, device: str):
        self.settings = settings
        self.worker_id = settings.worker.resolved_worker_id(self.role)
        engine = Engine.from_path(settings.worker.model, engine_config(settings, device, self.role))
        self.model_name = engine.model_config.name
        self.kv_scope = key_scope(engine, settings.pool)   # chunk keys of this KV (heartbeats, KV events)
        self.kv_events: KVEventPublisher | None = None
        self.engine = AsyncEngine(engine)
        self.device = str(self.engine.engine.device)
        self.bus: Bus | None = None
        self.tasks: dict[str, asyncio.Task] = {}   # request id -> its streaming task
        self.data_host, self.data_port = "", 0
        self.metrics_port = 0
        on_gpu = self.device.startswith("cuda")  # a GPU worker counts its GPUs (NVML), a CPU one RAPL
        self.energy = EnergyMeter(nvml=on_gpu, rapl=not on_gpu)
        self.timings: dict[str, _Timing] = {}      # request id -> when it arrived, its tier
        self.held: dict[str, Held] = {}            # requests in flight here (heartbeat ``requests``)
        self.moving: set[str] = set()              # requests being migrated away (services/decode.py)
        self.aborted: dict[str, float] = {}        # request id -> when an Abort for it arrived
        self.tpot = 0.0                            # moving average seconds per output token

    async def start(self) -> None:
        tracing.setup(self.role)
        self.metrics_port = metrics.serve_http(self.settings.worker.metrics_port,
                                               self.settings.worker.metrics_host) or 0
        self.bus = await Bus.connect(self.settings, name=self.worker_id)
        self.kv_events = await publish_chunk_events(self.bus, self.engine.engine, self.worker_id, self.role,
                                                    self.kv_scope)
        self._abort_sub = await self.bus.subscribe(subjects.ABORT, Abort, skip_invalid=True)
        self._abort_task = asyncio.create_task(self._abort_loop(), name="abort-listener")
        await self.register()
        self.bus.start_heartbeat(subjects.heartbeat(self.role, self.worker_id), self.heartbeat,
                                 self.settings.worker.heartbeat_interval)
        log.info("%s %s ready on %s (model %s)", self.role, self.worker_id, self.device, self.model_name)

    async def register(self) -> None:
        """Serve the role's subjects (subclasses)."""

    def heartbeat(self) -> Heartbeat:
        st = self.engine.stats()
        for domain, j in (self.energy.tick() or {}).items():
            metrics.ENERGY.labels(self.role, domain).inc(j)
        metrics.set_engine_load(self.role, queue_depth=st["waiting"] + st["queued_commands"], running=st["running"],
                                kv_used=st["total_kv_blocks"] - st["free_kv_blocks"], kv_free=st["free_kv_blocks"])
        return Heartbeat(worker_id=self.worker_id, role=self.role, device=self.device, model=self.model_name,
                         ready=True, queue_depth=st["waiting"] + st["queued_commands"], running=st["running"],
                         free_kv_blocks=st["free_kv_blocks"], total_kv_blocks=st["total_kv_blocks"],
                         max_context=self.engine.max_context, data_host=self.data_host,
                         data_port=self.data_port, ts=time.time(),
                         interval=self.settings.worker.heartbeat_interval, metrics_port=self.metrics_port,
                         requests=[[rid, h.session_id, h.tier] for rid, h in self.held.items()],
                         waiting_by_tier=self.waiting_by_tier(st), tpot_ms=round(self.tpot * 1e3, 3),
                         kv_scope=self.kv_scope.seed().hex(), chunk_tokens=self.kv_scope.chunk_tokens)

    @staticmethod
    def waiting_by_tier(st: dict) -> dict:
        out = dict.fromkeys(TIER_PRIORITY, 0)
        for prio, n in st.get("waiting_by_priority", {}).items():
            tier = TIER_OF_PRIORITY.get(prio, f"priority-{prio}")
            out[tier] = out.get(tier, 0) + n
        return out

    async def _abort_loop(self) -> None:
        async for msg in self._abort_sub:
            await self._on_abort(msg)

    async def _on_abort(self, msg: Abort) -> None:
        now = time.monotonic()
        self.aborted = {rid: t for rid, t in self.aborted.items() if now - t < ABORTED_TTL}
        self.aborted[msg.request_id] = now
        task = self.tasks.pop(msg.request_id, None)
        if task is not None:
            task.cancel()
        if await self.engine.abort(msg.request_id):
            log.info("%s aborted (%s)", msg.request_id, msg.reason or "client gone")

    def spawn(self, request_id: str, coro) -> None:
        task = asyncio.create_task(coro, name=f"stream-{request_id}")
        self.tasks[request_id] = task
        task.add_done_callback(lambda t, rid=request_id: self._stream_done(rid, t))

    def _stream_done(self, request_id: str, task: asyncio.Task) -> None:
        if self.tasks.get(request_id) is task:
            self.tasks.pop(request_id)
        if request_id not in self.tasks and request_id not in self.moving:
            self.held.pop(request_id, None)

    async def stream_outputs(self, request_id: str, subject: str, outputs: AsyncIterator[RequestOutput],
                             first_seq: int, on_parked=None) -> int | None:
        """Publish each output as a StreamChunk; the last one carries finish_reason and usage.
        ``on_parked`` is awaited with the output that ends a prefill-only request. A request
        migrated away ends without a chunk: the seq the next worker starts at is returned."""
        seq = first_seq
        timing = self.timings.pop(request_id, None)
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
                if out.finish_reason == "migrated":
                    self._observe(timing, first_at, emitted, "migrated")
                    return seq
                if out.finish_reason == "prefilled":
                    await self.bus.publish(subject, self.chunk(out, seq, finish=False))
                    self._observe(timing, first_at, emitted, "parked")
                    await on_parked(out)
                    return
                await self.bus.publish(subject, self.chunk(out, seq, finish=out.finished))
                seq += 1
                if out.finished:
                    self._observe(timing, first_at, emitted, "aborted" if out.finish_reason == "abort" else "ok")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the client hears about it, the worker goes on
            self._observe(timing, first_at, emitted, "error")
            log.exception("%s failed", request_id)
            await self.engine.abort(request_id)
            code = "overloaded" if isinstance(e, EngineFull) else getattr(e, "code", "internal")
            await self.bus.publish(subject, ErrorReply.of(code, f"{self.role} {self.worker_id}: {e}", request_id))

    def chunk(self, out: RequestOutput, seq: int, finish: bool) -> StreamChunk:
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
                           finish_reason=out.finish_reason if finish else None, usage=usage)

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

    async def admit(self, req, coro):
        """Run the engine admission of ``req`` (a message with request_id and tier); engine errors
        become coded bus errors for the requester. Records the request's queue time."""
        received = time.monotonic()
        try:
            out = await coro
        except EngineFull as e:
            metrics.observe_request(self.role, req.tier, outcome="error")
            raise BusError("overloaded", str(e)) from None
        metrics.observe_request(self.role, req.tier, queue=time.monotonic() - received)
        self.timings[req.request_id] = _Timing(req.tier, received)
        self.held[req.request_id] = Held(req.session_id or "", req.tier, req.stream_subject)
        return out

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        await stop.wait()
        log.info("%s %s draining %d request(s)", self.role, self.worker_id, len(self.tasks))
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=30)
        await self.close()

    async def close(self) -> None:
        for t in list(self.tasks.values()):
            t.cancel()
        self._abort_task.cancel()
        if self.kv_events is not None:
            await self.kv_events.close()
        if self.bus is not None:
            await self.bus.close()
        await self.engine.close()
