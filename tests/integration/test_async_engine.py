"""AsyncEngine streams on the real bundled model: a consumer that falls behind gets the waiting
outputs merged (one message for them), in order, with nothing lost and nothing held back."""

from __future__ import annotations

import asyncio

import pytest

from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.sampling import RequestOutput, SamplingParams


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
