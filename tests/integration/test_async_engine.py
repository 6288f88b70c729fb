"""AsyncEngine streams on the real bundled model: a consumer that falls behind gets the waiting
outputs merged (one message for them), in order, with nothing lost and nothing held back."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.sampling import RequestOutput, SamplingParams
from shared.os_priority import LANE_NAME, BatchLane, thread_priorities
from shared.tier import Tier


@pytest.fixture(scope="module")
def engine(bundled_model) -> Engine:
    return Engine(bundled_model, EngineConfig(num_kv_blocks=64))


async def test_slow_consumer_gets_merged_outputs_in_order(engine):
    ids = engine.tokenizer.encode("The lighthouse keeper wrote in his log that")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = run_to_completion(engine, {"ref": (ids, params)})["ref"]
    ae = AsyncEngine(engine)
    try:
        fast = [o async for o in ae.generate("fast", ids, params)]
        slow = []
        async for o in ae.generate("slow", ids, params):
            slow.append(o)
            await asyncio.sleep(0.03)  # several engine steps pass while this consumer is away
    finally:
        await ae.close()
    for outs in (fast, slow):
        assert [t for o in outs for t in o.token_ids] == ref.token_ids
        assert "".join(o.text for o in outs) == ref.text
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 40
    assert len(slow) < len(fast) and max(len(o.token_ids) for o in slow) > 1


async def test_drain_never_merges_into_a_migration_or_past_an_error(engine):
    ae = AsyncEngine(engine)
    try:
        def out(tok: int, reason: str | None = None) -> RequestOutput:
            return RequestOutput("m", [tok] if tok >= 0 else [], f"<{tok}>" if tok >= 0 else "", reason is not None,
                                 reason, None, 3, 0, max(tok, 0))

        q: asyncio.Queue = asyncio.Queue()
        for item in (out(1), out(2), out(-1, "migrated")):
            q.put_nowait(item)
        got = [o async for o in ae._drain("m", q)]
        assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [([1, 2], "<1><2>", None), ([], "", "migrated")]

        q = asyncio.Queue()
        for item in (out(1), out(2), RuntimeError("step failed")):
            q.put_nowait(item)
        seen = []
        with pytest.raises(RuntimeError, match="step failed"):
            async for o in ae._drain("e", q):
                seen.append(o.token_ids)
        assert seen == [[1, 2]]
    finally:
        await ae.close()


async def test_a_token_that_cannot_be_chosen_fails_its_request_alone(engine, monkeypatch):
    """A row whose choice raises (here on purpose, at its 5th token; before the sampler's
    fixes, a temperature of 1e-38) ends its own stream with the error; the requests batched with
    it get every token they get alone, and the engine serves on."""
    from shared.engine import sampler
    ids = engine.tokenizer.encode("The lighthouse keeper wrote in his log that")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = run_to_completion(engine, {"ref": (ids, params)})["ref"]
    choose = sampler._choose

    def failing(row, seq, best):
        if seq.request_id == "bad" and seq.num_output_tokens == 4:
            raise ValueError("no token to choose")
        return choose(row, seq, best)
    monkeypatch.setattr(sampler, "_choose", failing)
    ae = AsyncEngine(engine)
    try:
        async def stream(rid):
            return [o async for o in ae.generate(rid, ids, SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True, logprobs=True))]
        got = await asyncio.gather(stream("good1"), stream("bad"), stream("good2"), return_exceptions=True)
        assert isinstance(got[1], ValueError) and "no token to choose" in str(got[1])
        for outs in (got[0], got[2]):
            assert [t for o in outs for t in o.token_ids] == ref.token_ids and outs[-1].finish_reason == "length"
        assert "bad" not in engine.seqs and engine.stats()["running"] == 0
        after = [o async for o in ae.generate("after", ids, params)]
        assert [t for o in after for t in o.token_ids] == ref.token_ids
    finally:
        await ae.close()


async def test_batch_only_steps_run_on_the_batch_lane_with_its_kernel_team(bundled_model):
    """A step of batch sequences only runs on the lane's thread, and the kernels' OpenMP team
    that thread starts runs at its priority; a step with interactive work runs on the engine
    thread at normal priority — with the same greedy tokens either way."""
    engine = Engine(bundled_model, EngineConfig(num_kv_blocks=64, threads=2))
    ids = engine.tokenizer.encode("The lighthouse keeper wrote in his log that")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = run_to_completion(engine, {"ref": (ids, params)})["ref"]
    steps: list[tuple[int | None, int]] = []   # (best priority, thread) of every step
    step = engine.step
    engine.step = lambda: (steps.append((engine.best_priority(), threading.get_native_id())), step())[1]
    lane = BatchLane(19, "batch")
    ae = AsyncEngine(engine, lane)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        batch = [o async for o in ae.generate("b", ids, params, priority=Tier.BATCH.priority)]
        lane_threads = {tid: st for tid, st in thread_priorities().items() if st[0] == LANE_NAME}
        alone = list(steps)
        steps.clear()
        mixed = await asyncio.gather(*(collect(ae, rid, ids, params, Tier.parse(rid).priority)
                                       for rid in ("batch", "interactive")))
        engine_thread = ae._thread.native_id
        engine_stat = thread_priorities()[engine_thread]
    finally:
        await ae.close()
    assert [t for o in batch for t in o.token_ids] == ref.token_ids
    assert all([t for o in outs for t in o.token_ids] == ref.token_ids for outs in mixed)
    assert {tid for _, tid in alone} == {lane.native_id}
    assert len(lane_threads) >= 2, lane_threads        # the lane and its kernel team's thread(s)
    assert set(lane_threads.values()) == {(LANE_NAME, max(19, base), os.SCHED_BATCH)}
    assert {tid for prio, tid in steps if prio == Tier.INTERACTIVE.priority} == {engine_thread}
    assert engine_stat[1:] == (base, os.SCHED_OTHER)


async def collect(ae: AsyncEngine, rid: str, ids, params, priority: int) -> list[RequestOutput]:
    return [o async for o in ae.generate(rid, ids, params, priority=priority)]


async def test_queued_requests_count_requests_not_other_commands(engine):
    """``stats()["queued_requests"]`` (a worker's heartbeat adds it to ``queue_depth``, which the
    router's placement and 429s read): requests handed to the engine thread and not yet taken —
    not its other commands (priority changes during a tier flip counted as waiting requests)."""
    ae = AsyncEngine(engine)
    gate, busy = threading.Event(), threading.Event()
    try:
        def hold():
            busy.set()
            gate.wait(10)
        threading.Thread(target=ae.run_blocking, args=(hold,), daemon=True).start()
        assert busy.wait(5)                      # the engine thread is inside ``hold``
        others = [asyncio.create_task(ae.set_priority(f"nobody-{i}", 0)) for i in range(3)]
        ids = engine.tokenizer.encode("One request waits")
        add = asyncio.create_task(ae.submit("waiting", ids, SamplingParams(max_tokens=2, temperature=0.0)))
        await asyncio.sleep(0.05)
        assert ae.stats()["queued_requests"] == 1
        gate.set()
        outs = [o async for o in await add]
        await asyncio.gather(*others, return_exceptions=True)
        assert outs[-1].finished and ae.stats()["queued_requests"] == 0
    finally:
        gate.set()
        await ae.close()
