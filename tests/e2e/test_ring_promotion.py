"""Promotion of a ring session to one worker (docs/strategies.md) through the real stack:
`tandem up --gpu-decode 1 --cpu-decode 2` with cpu-decode workers of 30 MB of KV, secured NATS,
the official openai client."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from shared import subjects
from shared.bus import Bus
from shared.schemas import RoutePlan
from tests.e2e.test_ring import BATCH, WIDE_ENV, _collect, question, reference  # noqa: F401 (fixture)
from tests.e2e.test_resilience import collect
from tests.e2e.test_stack import local_chat, running_stack

pytestmark = pytest.mark.timeout(900)
NEW = 160


@pytest.mark.slow   # 68 s on a 2-vCPU AVX2 EPYC: the slow lane (promotion of a single worker's session: test_tiers)
def test_a_ring_session_is_promoted_to_a_gpu_worker_when_a_person_checks_in(nats_server, reference):
    """`--gpu-decode 1 --cpu-decode 2`: a batch session's 2,000-token chat runs on a ring of the two
    cpu-decode workers; mid-stream its session turns interactive (POST /v1/sessions/{id}) and the
    router moves it to the gpu-decode worker — the coordinator gathers the shards into a
    migration — and the client gets the undisturbed greedy text."""
    env = dict(WIDE_ENV, TANDEM_KV_BUDGET_MB_GPU_DECODE="256")
    content = question(reference, 2000)
    # 160 tokens: the stream must outlast the router's next tick and the move; with 48 it ended
    # 1.7 s after the POST on an AMX Xeon, the coordinator's heartbeat not yet listing it (2026-12-01)
    _, want = local_chat(reference, content, NEW, ignore_eos=True)
    with running_stack(nats_server, ["--gpu-decode", "1", "--cpu-decode", "2", "--kvpool", "0"], env=env) as s:
        async def run() -> tuple[dict, list, list[RoutePlan]]:
            client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
            model = (await client.models.list()).data[0].id
            bus = await Bus.connect(url=nats_server, name="e2e-ring-promote")
            plans: list[RoutePlan] = []
            sub = await bus.subscribe(subjects.ROUTER_DECISION, RoutePlan, skip_invalid=True)
            noting = asyncio.create_task(_collect(sub, plans))
            moved: list = []

            async def on_chunk(o):
                if o["chunks"] == 3:
                    async with httpx.AsyncClient() as c:
                        r = await c.post(f"{s.url}/v1/sessions/promote-me", json={"tier": "interactive"})
                    moved.append(r.json())

            try:
                st = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": content}], max_tokens=NEW, temperature=0,
                    stream=True, extra_headers=BATCH, extra_body={"ignore_eos": True, "session_id": "promote-me"})
                out = await collect(st, on_chunk)
            finally:
                noting.cancel()
                await bus.close()
            return out, moved, plans

        got, moved, plans = asyncio.run(run())
    assert got["text"] == want.text and got["finish"] == "length"
    mine = [p for p in plans if p.request_id == got["id"]]
    assert mine[0].strategy == "cpu-ring(2)", mine
    assert moved and moved[0]["tier"] == "interactive", moved
    # the move: at once (the POST's reply lists it) or at the router's next tick (its view of the
    # coordinator's requests lagged a heartbeat)
    assert len(mine) == 2 and mine[1].moved_from == mine[0].decode_worker, mine
    assert mine[1].decode_role == "gpu-decode" and mine[1].decode_worker.startswith("gpu-decode"), mine
