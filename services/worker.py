"""What every engine worker (prefill, gpu-decode, cpu-decode) shares: the engine, the bus
connection, heartbeats with load, aborts, and streaming outputs as ``StreamChunk`` messages.

Life cycle of a request in a worker: Accepted (the engine took it; the handler acks) →
Streaming (a task publishes each output on the request's stream subject) → Done (finished,
aborted, or failed: a failure is published on the stream as an ``ErrorReply``, never silence).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from shared import subjects
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

    async def start(self) -> None:
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
        return Heartbeat(worker_id=self.worker_id, role=self.role, device=self.device, model=self.model_name,
                         ready=True, queue_depth=st["waiting"] + st["queued_commands"], running=st["running"],
                         free_kv_blocks=st["free_kv_blocks"], total_kv_blocks=st["total_kv_blocks"],
                         max_context=self.engine.max_context, data_host=self.data_host,
                         data_port=self.data_port, ts=time.time(),
                         interval=self.settings.worker.heartbeat_interval)

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
        try:
            async for out in outputs:
                if out.finish_reason == "prefilled":
                    await self.bus.publish(subject, self.chunk(out, seq, finish=False))
                    await on_parked(out)
                    return
                await self.bus.publish(subject, self.chunk(out, seq, finish=out.finished))
                seq += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the client hears about it, the worker goes on
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

    async def admit(self, coro):
        """Run an engine admission; engine errors become coded bus errors for the requester."""
        try:
            return await coro
        except EngineFull as e:
            raise BusError("overloaded", str(e)) from None

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
