"""SLA tiers through the whole stack (`tandem up`, real NATS, the bundled model, the official
openai client): a session promoted to GPU decode and demoted back mid-stream through
POST /v1/sessions/{id} without a gap or a repeated token, an interactive request served while a
batch flood decodes, and 429 + Retry-After when the batch queue is full — with no accepted request lost."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from tests.e2e.test_stack import running_stack

PROMPT = "Write a long story about a lighthouse keeper and a storm."
FLOOD = "Summarize the history of the printing press in detail. " * 12


@pytest.fixture(scope="module")
def stack(nats_server):
    with running_stack(nats_server, ["--prefill", "0", "--gpu-decode", "1", "--cpu-decode", "1", "--kvpool", "0"],
                       env={"TANDEM_QUEUE_BATCH": "3", "TANDEM_MAX_SEQS": "4"}, workers={"gpu-decode": 1, "cpu-decode": 1}) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def stream_text(client, model, tier, session=None, on_chunk=None, max_tokens=48) -> tuple[str, int]:
    """Greedy streamed chat: (text, completion tokens); ``on_chunk(n)`` after the n-th content chunk."""
    headers = {"X-Tandem-SLA": tier, **({"X-Tandem-Session": session} if session else {})}
    text, n, usage = "", 0, None
    for ch in client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                             max_tokens=max_tokens, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_headers=headers,
                                             extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
            n += 1
            if on_chunk:
                on_chunk(n)
        if ch.usage:
            usage = ch.usage
    return text, usage.completion_tokens


def test_session_promoted_and_demoted_mid_stream(stack, client, model):
    """A session's tier changed at its stream's 2nd content chunk moves the running request
    (batch → interactive: cpu-decode → gpu-decode, and back) with the same greedy text. 128
    tokens: a batch stream's chunks carry several tokens (coalescing), so a short request could
    end on the worker before the client has read a few chunks and asked for the move."""
    want, want_n = stream_text(client, model, "standard", max_tokens=128)
    moves = []

    def set_tier(session: str, tier: str, at: int):
        def on_chunk(n):
            if n == at:
                r = httpx.post(f"{stack.url}/v1/sessions/{session}", json={"tier": tier}, timeout=60)
                assert r.status_code == 200, r.text
                moves.append(r.json())
        return on_chunk

    up, up_n = stream_text(client, model, "batch", "agent-up", set_tier("agent-up", "interactive", 2), max_tokens=128)
    down, down_n = stream_text(client, model, "interactive", "agent-down", set_tier("agent-down", "batch", 2),
                               max_tokens=128)
    assert (up, up_n) == (want, want_n) == (down, down_n)   # no gap, no repeat, same greedy tokens
    assert [len(m["moved"]) for m in moves] == [1, 1], moves
    promoted, demoted = moves[0]["moved"][0], moves[1]["moved"][0]
    assert promoted["source"].startswith("cpu-decode") and promoted["target"].startswith("gpu-decode")
    assert demoted["source"].startswith("gpu-decode") and demoted["target"].startswith("cpu-decode")
    # the promoted session's next batch turn runs interactive: the response says the tier it ran at
    r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=300,
                   json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                   headers={"X-Tandem-SLA": "batch", "X-Tandem-Session": "agent-up"})
    assert r.status_code == 200 and r.headers["x-tandem-sla"] == "interactive", r.headers
    assert moves[0]["tier"] == "interactive" and moves[1]["tier"] == "batch"


def test_a_session_set_to_batch_on_its_own_pool_runs_at_batch_where_it_is(stack, client, model):
    """A standard session set to batch mid-stream: its pool (cpu-decode) is batch's too, so it
    does not move — it runs on at the batch tier there (its engine's priority, the heartbeat's
    tier): the update names it as moved in place, and the text is the undisturbed run's. It
    kept the standard tier there before (preempting and queueing as standard)."""
    want, _ = stream_text(client, model, "standard", max_tokens=128)
    moves = []

    def on_chunk(n):
        if n == 2:
            r = httpx.post(f"{stack.url}/v1/sessions/agent-retier", json={"tier": "batch"}, timeout=60)
            assert r.status_code == 200, r.text
            moves.append(r.json())
    got, _ = stream_text(client, model, "standard", "agent-retier", on_chunk, max_tokens=128)
    assert got == want
    [moved] = moves[0]["moved"]
    assert moved["source"] == moved["target"] and moved["source"].startswith("cpu-decode"), moves
    assert "runs at tier batch here" in stack.tail(400)


def test_interactive_is_served_during_a_batch_flood(stack, model):
    """Three batch requests decoding in the engines (each has streamed its first token): an
    interactive request that arrives then gets its first token while every batch request is
    still decoding — it does not wait for the flood to drain — and the batch work finishes whole.
    Event order, not a wall-clock threshold: a loaded machine slows both sides alike."""
    batch_tokens = 128   # long enough that no batch request ends before the others have started, on a busy machine too

    async def go():
        ac = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0, timeout=600)
        decoding = asyncio.Semaphore(0)
        order = []                                    # ("first" | "end", request), as they happened

        async def batch(i):
            try:
                stream = await ac.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": FLOOD}], max_tokens=batch_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}, extra_headers={"X-Tandem-SLA": "batch"})
            except openai.RateLimitError:
                decoding.release()
                return "429"
            usage = None
            async for ch in stream:
                if ch.choices and ch.choices[0].delta.content and ("first", i) not in order:
                    order.append(("first", i))
                    decoding.release()
                usage = ch.usage or usage
            order.append(("end", i))
            return usage.completion_tokens

        async def interactive():
            async with asyncio.timeout(300):          # only catches a hang
                for _ in range(3):
                    await decoding.acquire()          # every batch request is decoding (or was refused)
            stream = await ac.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
                stream=True, extra_headers={"X-Tandem-SLA": "interactive"})
            async for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    order.append(("first", "interactive"))
                    break
            async for _ in stream:
                pass

        *flood, _ = await asyncio.gather(*(batch(i) for i in range(3)), interactive())
        return flood, order

    flood, order = asyncio.run(go())
    assert flood == [batch_tokens] * 3, flood         # all three admitted (limit 3) and none lost
    first = order.index(("first", "interactive"))
    assert not [e for e in order[:first] if e[0] == "end"], order   # no batch request had finished


def test_full_batch_queue_gets_429_with_retry_after_and_loses_nothing(stack, model):
    """12 batch requests at once onto one cpu-decode worker of 4 slots with a batch queue of 3:
    some get 429 + Retry-After, every admitted one finishes whole, an interactive request still
    gets in. The threads post together (a barrier) and each asks 24 tokens: on a fast machine
    (AMX), 10 requests of 8 tokens posted one after another ended faster than they came, the
    queue never filled and all got 200 (2026-12-01)."""
    statuses, retry_after, done = [], [], []
    n = 12
    together = threading.Barrier(n)

    def batch():
        body = {"model": model, "messages": [{"role": "user", "content": FLOOD}], "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}
        together.wait(60)
        r = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers={"X-Tandem-SLA": "batch"},
                       timeout=600)
        statuses.append(r.status_code)
        if r.status_code == 429:
            retry_after.append(r.headers.get("retry-after"))
            assert r.json()["error"]["code"] == "overloaded"
        elif r.status_code == 200:
            done.append(r.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=batch) for _ in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300                         # only catches a hang
    while 429 not in statuses and any(t.is_alive() for t in threads):
        assert time.monotonic() < deadline, statuses
        time.sleep(0.02)
    # the batch queue is full (or the flood is over, which the asserts below catch): other tiers get in
    r = httpx.post(f"{stack.url}/v1/chat/completions", headers={"X-Tandem-SLA": "interactive"}, timeout=600,
                   json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    for t in threads:
        t.join()
    assert r.status_code == 200                               # other tiers still get in
    assert 429 in statuses and set(statuses) <= {200, 429}, statuses
    assert all(ra is not None and int(ra) >= 1 for ra in retry_after), retry_after
    assert done and all(k == 24 for k in done)                # every admitted request finished whole


@pytest.mark.slow
def test_a_burst_through_two_routers_never_runs_past_a_worker_s_slots(nats_server):
    """Eight interactive streams at once through two router copies onto workers of 4 slots: each
    copy counts only what it has heard of, so together they placed 7 on the gpu-decode worker (a
    probe, 2026-11-30), whose engine ran them all past its cap (a hand-off from prefill always
    came in). A hand-off to a full worker now waits its turn there, its KV in host memory: no
    heartbeat says more running than max_running, and every stream is the same exact text."""
    from shared import subjects
    from shared.bus import Bus
    from shared.schemas import Heartbeat
    args = ["--router", "2", "--prefill", "1", "--gpu-decode", "1", "--cpu-decode", "1", "--kvpool", "0"]
    with running_stack(nats_server, args, env={"TANDEM_MAX_SEQS": "4"}) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        model = c.models.list().data[0].id
        over: list[tuple[str, int, int]] = []

        async def go():
            bus = await Bus.connect(url=nats_server, name="test-burst")
            sub = await bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, skip_invalid=True)

            async def watch():
                async for b in sub:
                    if b.role in subjects.DECODE_ROLES and b.max_running and b.running > b.max_running:
                        over.append((b.worker_id, b.running, b.max_running))
            watcher = asyncio.create_task(watch())
            try:
                return await asyncio.gather(*(asyncio.to_thread(stream_text, c, model, "interactive", None, None, 64)
                                              for _ in range(8)))
            finally:
                watcher.cancel()
                await bus.close()
        texts = asyncio.run(go())
        assert over == [] and len({t for t, _ in texts}) == 1 and all(n == 64 for _, n in texts), (over, texts)
