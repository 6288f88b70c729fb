"""The engine for asyncio services: one thread steps the engine, coroutines stream results.

Commands (add, abort, export, import) are queued to the engine thread and run between
steps, so the engine is only ever touched by that thread. The thread sleeps when idle.
A consumer that stops iterating ``generate`` (a client went away) aborts its request.
A step's outputs reach each event loop with one wake-up (``_deliver_step``); a consumer that
fell behind gets the outputs waiting for it merged into one (``_drain``).
A migration (``export_for_move`` then ``end_move``) parks a decoding request between two steps;
its stream ends with a "migrated" output, after every output produced before.
With a ``batch_lane`` (shared/os_priority.py), a step whose sequences are all batch-tier runs on
that lane's low-priority thread instead (the engine thread waits for it), so the OS schedules it
below every other step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from shared.engine.engine import Engine
from shared.engine.sampling import RequestOutput, SamplingParams, merge_outputs
from shared.tier import Tier

BATCH_PRIORITY = Tier.BATCH.priority

log = logging.getLogger("tandem.engine")


class AsyncEngine:
    def __init__(self, engine: Engine, batch_lane=None):
        self.engine = engine
        self.batch_lane = batch_lane   # runs batch-only steps at the batch priority (None: every step here)
        self.tokenizer = engine.tokenizer
        self.max_context = engine.max_context
        self.model_identity = engine.model_identity   # what the KV belongs to (pool keys, blobs)
        self.layout = engine.layout
        self.model_name = engine.model_config.name
        self.device = str(engine.device)
        self._commands: queue.Queue[tuple[Callable[[], Any], asyncio.Future | None, asyncio.AbstractEventLoop | None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._adds = 0                      # requests queued as commands, not yet taken by the engine
        self._adds_lock = threading.Lock()
        self._stats = engine.stats()
        self.step_started: float | None = None   # monotonic time the running step began (None: between steps)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # ---- engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            block = not self.engine.has_work()
            try:
                while True:
                    fn, fut, loop = self._commands.get(block=block, timeout=0.5 if block else None)
                    block = False
                    try:
                        res = fn()
                    except BaseException as e:  # handed to the awaiting coroutine, never lost
                        if loop is not None:
                            loop.call_soon_threadsafe(_settle, fut, None, e)
                        elif fut is not None:  # run_blocking's
                            fut.set_exception(e)
                        else:
                            log.exception("engine command failed")
                    else:
                        if loop is not None:
                            loop.call_soon_threadsafe(_settle, fut, res, None)
                        elif fut is not None:
                            fut.set_result(res)
            except queue.Empty:
                pass
            self._stats = self.engine.stats()
            if not self.engine.has_work():
                continue
            self.step_started = time.monotonic()
            try:
                outputs = self._step()
            except Exception as e:  # a failed step fails the requests in it, not the service
                log.exception("engine step failed")
                for rid in list(self._streams):
                    self._abort(rid, deliver=False)  # the stream gets the error instead
                    self._deliver(rid, e)
                continue
            finally:
                self.step_started = None
            self._stats = self.engine.stats()
            self._deliver_step(outputs)
            for rid, e in self.engine.take_failed():   # ring sessions that lost a member
                self._deliver(rid, e)

    def _step(self) -> list[RequestOutput]:
        if self.batch_lane is not None and self.engine.best_priority() == BATCH_PRIORITY:
            return self.batch_lane.run(self.engine.step)
        return self.engine.step()

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        entry = self._streams.get(rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams with one wake-up per event loop, not one per
        output (a step of 16 sequences would otherwise wake the loop 16 times)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def run_blocking(self, fn: Callable[[], Any], timeout: float = 60.0) -> Any:
        """Run ``fn`` on the engine thread from another thread (not an event loop's) and return
        its result; called on the engine thread, it just runs ``fn``."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut, None))
        return fut.result(timeout)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put((fn, fut, loop))
        return await fut

    # ---- API --------------------------------------------------------------------------
    def stats(self) -> dict:
        """Load figures as of the last step (for heartbeats), with ``queued_requests``: requests
        handed to the engine thread that it has not taken yet (waiting like ``waiting``'s; the
        other commands — priority changes, exports — are not requests)."""
        return dict(self._stats, queued_requests=self._adds)

    def stalled(self, limit: float) -> bool:
        """A step has run for more than ``limit`` seconds (a hung engine: not ready for work)."""
        started = self.step_started
        return started is not None and time.monotonic() - started > limit

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     priority: int = 1, prefill_only: bool = False,
                     prefix: tuple[list[int], bytes] | None = None, resume_token_ids: list[int] | None = None,
                     emitted_chars: int = 0, tenant: str = "") -> AsyncIterator[RequestOutput]:
        """Queue a request of ``tenant``; once the engine has taken it, return the stream of its outputs.
        ``prefix``: (token ids, KV bytes) of a prefix from the KV pool, loaded in the same engine
        command (``Engine.add``), so the request reuses it. ``resume_token_ids`` /
        ``emitted_chars``: continue a request that ran elsewhere (``Engine.add``). Raises
        ValueError (bad input) or EngineFull here, before any output."""
        def add() -> None:
            self.engine.add(request_id, prompt_token_ids, params, priority, prefill_only,
                            resume_token_ids=resume_token_ids, emitted_chars=emitted_chars, tenant=tenant,
                            prefix=prefix)

        return await self._opened(request_id, add)

    async def submit_kv(self, request_id: str, blob: bytes, priority: int | None = None, at_cap: str = "queue"
                        ) -> AsyncIterator[RequestOutput]:
        """Import an exported sequence (``Engine.import_kv``); the stream of the rest of its outputs."""
        return await self._opened(request_id, lambda: self.engine.import_kv(request_id, blob, priority, at_cap))

    async def submit_ring(self, request_id: str, blob, ring, sid: str, priority: int | None = None
                          ) -> AsyncIterator[RequestOutput]:
        """Decode an exported sequence on ``ring`` (its KV already scattered there as session
        ``sid``: ``Engine.add_ring``); the stream of the rest of its outputs."""
        return await self._opened(request_id, lambda: self.engine.add_ring(request_id, blob, ring, sid, priority))

    async def _opened(self, request_id: str, add: Callable[[], Any]) -> AsyncIterator[RequestOutput]:
        loop, q = asyncio.get_running_loop(), asyncio.Queue()

        def open_and_add() -> None:
            with self._adds_lock:
                self._adds -= 1
            self._check_closed(request_id)
            add()
            self._streams[request_id] = (loop, q)
        with self._adds_lock:
            self._adds += 1
        await self._call(open_and_add)
        return self._drain(request_id, q)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 1, prefill_only: bool = False, tenant: str = "") -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (``submit`` and iterate)."""
        async for out in await self.submit(request_id, prompt_token_ids, params, priority, prefill_only,
                                           tenant=tenant):
            yield out

    async def export_kv(self, request_id: str, written_back: bool = False) -> bytes:
        return await self._call(lambda: self.engine.export_kv(request_id, written_back=written_back))

    async def export_for_move(self, request_id: str) -> bytes:
        """Park a decoding request and serialise it (``Engine.export_kv(keep=True)``); its stream
        ends with a "migrated" output. KeyError: unknown; ValueError: not between decode steps.
        Always follow with ``end_move``."""
        def export() -> bytes:
            blob = self.engine.export_kv(request_id, keep=True)
            seq = self.engine.seqs[request_id]
            entry = self._streams.pop(request_id, None)
            if entry is not None:
                loop, q = entry
                loop.call_soon_threadsafe(q.put_nowait, RequestOutput(
                    request_id, [], "", True, "migrated", None, seq.num_prompt_tokens,
                    seq.num_cached_tokens, seq.num_output_tokens))
            return blob

        return await self._call(export)

    async def end_move(self, request_id: str, moved: bool) -> AsyncIterator[RequestOutput] | None:
        """After ``export_for_move``: ``moved`` drops the parked request; else it decodes on here
        and its new output stream is returned (None if it was aborted meanwhile)."""
        if moved:
            await self._call(lambda: self.engine.settle_export(request_id, True))
            return None
        loop, q = asyncio.get_running_loop(), asyncio.Queue()

        def settle() -> bool:
            self._check_closed(request_id)
            resumed = self.engine.settle_export(request_id, False)
            if resumed:
                self._streams[request_id] = (loop, q)
            return resumed
        if not await self._call(settle):
            return None
        return self._drain(request_id, q)

    async def watch_chunks(self, seed: bytes, chunk_tokens: int,
                           hook: Callable[[list[str], list[str]], None]) -> None:
        """``Engine.watch_chunks``: ``hook(stored, evicted)`` runs on the engine thread after a
        step that changed which pool chunks the prefix cache holds (hand results to a loop with
        ``call_soon_threadsafe``)."""
        await self._call(lambda: self.engine.watch_chunks(seed, chunk_tokens, hook))

    async def on_finished_kv(self, align: int, hook: Callable[[list[int], memoryview, str, int, str, int], None],
                             skip: int = 0) -> None:
        """``hook(token_ids, kv, tenant, prompt tokens, retention, start)`` on the engine thread when
        a request finishes, with its first ``align``-multiple computed tokens and the KV of those
        from ``start``: the whole ``skip`` units of the prefix it reused are left out (0: none) —
        the KV pool's write-back, whose chunks those are."""
        def install() -> None:
            self.engine.finished_kv_align, self.engine.finished_kv_skip = align, skip
            self.engine.finished_kv_hook = lambda rid, tokens, kv, tenant, prompt, ret, start: hook(
                tokens, kv, tenant, prompt, ret, start)
        await self._call(install)

    async def on_spill(self, hook: Callable[[list[int], memoryview, str, str, str], None]) -> None:
        """``hook(token_ids, kv, tenant, retention, session)`` on the engine thread when a resident
        session is evicted (``retention.py``): its KV, to keep in the pool."""
        def install() -> None:
            self.engine.spill_hook = hook
        await self._call(install)

    def tag_session(self, request_id: str, session: str, retention: str = "") -> None:
        """Before a session's request is submitted: its session and retention (``retention.Residency.tag``)."""
        if self.engine.residency is not None:
            self.engine.residency.tag(request_id, session, retention)

    async def warm_up(self) -> float:
        """``Engine.warm_up`` on the engine's thread (its kernel thread team is that thread's)."""
        return await self._call(self.engine.warm_up)

    async def set_priority(self, request_id: str, priority: int) -> None:
        await self._call(lambda: self.engine.set_priority(request_id, priority))

    async def cached_prefix_tokens(self, token_ids: list[int], tenant: str = "") -> int:
        return await self._call(lambda: self.engine.cached_prefix_tokens(token_ids, tenant))

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda: self._abort(request_id, deliver=True))

    def _abort(self, request_id: str, deliver: bool) -> bool:
        """``Engine.abort`` on the engine thread, its "abort" output handed over at once: to the
        stream open under the id now (``deliver``), or to none. Left for the next step, it went to
        whatever stream was open under the id then: a resume of the request admitted here
        meanwhile, which ended with the older attempt's abort (issue 33)."""
        if not self.engine.abort(request_id):
            return False
        for out in self.engine.take_pending(request_id):
            if deliver:
                self._deliver(request_id, out)
        return True

    def _check_closed(self, request_id: str) -> None:
        """On the engine thread, before a request's stream opens. A stream is registered in the
        same engine command that adds its sequence, never before: outputs are handed to the
        stream open under their request id at that moment, and one registered early (on the event
        loop, while the engine thread was inside a step) got the last outputs of an older
        sequence of the same id still in that step — a token and then its abort, at the start of
        a resumed attempt: issue 33's drifted texts ending "abort"."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already streaming")

    async def _drain(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """The stream's outputs in order. Outputs that are already waiting when the consumer
        comes back for more (it fell a step or more behind) are merged into one, so a consumer
        that publishes each output sends one message for all of them; nothing is held back."""
        finished = False
        held = None   # taken from the queue but not mergeable: the next one yielded
        try:
            while True:
                item, held = (held if held is not None else await q.get()), None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                while not item.finished and not q.empty():
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException) or nxt.finish_reason == "migrated":
                        held = nxt   # an error or a migration ends the stream on its own
                        break
                    item = merge_outputs(item, nxt)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # only this stream's own request: a generator closed late (after a resume re-added the
            # id) must not abort the newer one, which the engine knows by the same id
            if self._streams.get(request_id, (None, None))[1] is q:
                self._streams.pop(request_id, None)
                if not finished:  # the consumer left early: free the request's KV (nobody reads its abort)
                    self._commands.put((lambda: self._abort(request_id, deliver=False), None, None))

    async def close(self) -> None:
        self._closed = True
        self._commands.put((lambda: None, None, None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5)
        if self.batch_lane is not None:
            self.batch_lane.close()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
