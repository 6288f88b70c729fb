"""What every engine worker (prefill, gpu-decode, cpu-decode) shares: the engine, the bus
connection, heartbeats with load, aborts, and streaming outputs as ``StreamChunk`` messages.

Life cycle of a request in a worker: Accepted (the engine took it; the handler acks) →
Streaming (a task publishes each output on the request's stream subject) → Done (finished,
aborted, or failed: a failure is published on the stream as an ``ErrorReply``, never silence).

Metrics (shared/metrics.py, on this process's own /metrics port, announced in heartbeats):
per tier, queue time = handler received → engine took the request, TTFT = received → first
output published, TPOT; engine load and KV blocks from each heartbeat.
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

log = logging.getLogger("tandem.worker")


def engine_config(settings: Settings, device: str) -> EngineConfig:
    w = settings.worker
    return EngineConfig(device=device, threads=w.threads or None, num_kv_blocks=w.kv_blocks or None,
                        kv_cache_bytes=w.kv_budget_mb << 20, max_context=w.max_context or None)


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


class EngineWorker:
    role: str = ""

    def __init__(self, settings: Settings, device: str):
        self.settings = settings
        self.worker_id = settings.worker.resolved_worker_id(self.role)
        engine = Engine.from_path(settings.worker.model, engine_config(settings, device))
        self.model_name = engine.model_config.name
        self.engine = AsyncEngine(engine)
        self.device = str(self.engine.engine.device)
        self.bus: Bus | None = None
        self.tasks: dict[str, asyncio.Task] = {}   # request id -> its streaming task
        self.data_host, self.data_port = "", 0
        self.metrics_port = 0
        on_gpu = self.device.startswith("cuda")  # a GPU worker counts its GPUs (NVML), a CPU one RAPL
        self.energy = EnergyMeter(nvml=on_gpu, rapl=not on_gpu)
        self.timings: dict[str, _Timing] = {}      # request id -> when it arrived, its tier

    async def start(self) -> None:
        tracing.setup(self.role)
        self.metrics_port = metrics.serve_http(self.settings.worker.metrics_port,
                                               self.settings.worker.metrics_host) or 0
        self.bus = await Bus.connect(self.settings, name=self.worker_id)
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
                         interval=self.settings.worker.heartbeat_interval, metrics_port=self.metrics_port)

    async def _abort_loop(self) -> None:
        async for msg in self._abort_sub:
            await self._on_abort(msg)

    async def _on_abort(self, msg: Abort) -> None:
        task = self.tasks.pop(msg.request_id, None)
        if task is not None:
            task.cancel()
        if await self.engine.abort(msg.request_id):
            log.info("%s aborted (%s)", msg.request_id, msg.reason or "client gone")

    def spawn(self, request_id: str, coro) -> None:
        task = asyncio.create_task(coro, name=f"stream-{request_id}")
        self.tasks[request_id] = task
        task.add_done_callback(lambda t, rid=request_id: self.tasks.pop(rid, None) if self.tasks.get(rid) is t else None)

    async def stream_outputs(self, request_id: str, subject: str, outputs: AsyncIterator[RequestOutput],
                             first_seq: int, on_parked=None) -> None:
        """Publish each output as a StreamChunk; the last one carries finish_reason and usage.
        ``on_parked`` is awaited with the output that ends a prefill-only request."""
        seq = first_seq
        timing = self.timings.pop(request_id, None)
        first_at, emitted = None, 0     # this worker's first token, tokens it published
        try:
            async for out in outputs:
                if first_at is None and out.token_ids:
                    first_at = time.monotonic()
                emitted += len(out.token_ids)
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
        if self.bus is not None:
            await self.bus.close()
        await self.engine.close()
