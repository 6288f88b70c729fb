"""The whole stack as users run it: `tandem up` processes on a real NATS server, spoken to
with the official openai client over real HTTP."""

from __future__ import annotations

import argparse
import atexit
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import uuid

import httpx
import nats
import openai
import pytest

from bench.serve import Server
from services import up
from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.sampling import SamplingParams
from shared.nats_server import free_port

QUESTION = "What is the capital of France?"


def start_stack(nats_url: str | None, extra_args=(), env: dict | None = None) -> Server:
    """`tandem up` as a user runs it; NATS at ``nats_url``, or embedded when None; ``env``: more
    variables for every service (None: the variable unset)."""
    port = free_port()
    # a pool directory of its own (unless ``env`` names one): entries left by earlier runs in the
    # user's ~/.cache/tandem/kvpool would serve a repeated test prompt from the pool
    pool_dir = tempfile.mkdtemp(prefix="tandem-e2e-pool-")
    atexit.register(shutil.rmtree, pool_dir, True)
    env = {**os.environ, "TANDEM_PORT": str(port), "TANDEM_THREADS": "1", "TANDEM_KV_BUDGET_MB": "64",
           "TANDEM_HEARTBEAT_INTERVAL": "0.5", "PYTHONUNBUFFERED": "1", "TANDEM_POOL_DIR": pool_dir, **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    env.pop("TANDEM_NATS_URL", None)
    if nats_url:
        env["TANDEM_NATS_URL"] = nats_url
    return Server("stack", [sys.executable, "-m", "services.cli", "up", *extra_args], env, port)


def wait(cond, timeout: float) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` s pass (False)."""
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def bus_denials(s: Server) -> list[str]:
    """The stack's log lines where NATS refused a service something (a permission the feature
    needs and its role lacks, shared/bus_auth.py): the feature then fails silently, or falls back."""
    return [line for line in s.log if "permissions violation" in line.lower() or "authorization violation"
            in line.lower() or "JetStream unavailable" in line]


def planned_workers(extra_args=()) -> dict[str, int]:
    """Live workers per role (as /health lists them) that `tandem up extra_args` starts."""
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    args = p.parse_known_args(list(extra_args))[0]
    up.topology(args)
    counts = {"router": args.router, "prefill": args.prefill, "gpu-decode": args.gpu_decode,
              "cpu-decode": args.cpu_decode, "kvpool": args.kvpool}
    return {role: n for role, n in counts.items() if n}


@contextlib.contextmanager
def running_stack(nats_url: str | None, extra_args=(), env: dict | None = None, workers: dict | None = None,
                  timeout: float = 180):
    """A started stack with every worker it plans live (or ``workers`` per role); stopped cleanly
    after. Waiting for each worker, not just for /health's "ready" (one router and one decode
    worker), keeps a test from racing a worker that is still loading on a busy machine."""
    s = start_stack(nats_url, extra_args, env)
    try:
        s.wait_workers(workers or planned_workers(extra_args), timeout)
        yield s
    finally:
        rc = s.stop()
        assert rc == 0, s.tail()
        assert not bus_denials(s)


@pytest.fixture(scope="module")
def stack(nats_server):
    with running_stack(nats_server) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def local_engine(bundled_model) -> Engine:
    return Engine(bundled_model, EngineConfig(num_kv_blocks=128))


def chat_ids(engine: Engine, question: str) -> list[int]:
    """The prompt ids of a one-message chat."""
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)


def local_chat(engine: Engine, question: str, max_tokens: int, **kw):
    ids = chat_ids(engine, question)
    return ids, run_to_completion(engine, {"x": (ids, SamplingParams(max_tokens=max_tokens, temperature=0, **kw))})["x"]


def test_chat_greedy_matches_in_process_engine(client, model_name, local_engine):
    ids, want = local_chat(local_engine, QUESTION, 40)
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=40, temperature=0)
    assert r.choices[0].message.content == want.text
    assert "Paris" in want.text
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == want.num_output_tokens


def test_streaming_chat_with_usage(client, model_name, local_engine):
    _, want = local_chat(local_engine, QUESTION, 40)
    stream = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    assert text == want.text
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens == want.num_output_tokens


def test_max_tokens_gives_length(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Tell me a story."}],
                                       max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_stop_string(client, model_name, local_engine):
    _, free = local_chat(local_engine, QUESTION, 30)
    stop = free.text.split()[3]  # a word from the middle of the answer
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == free.text[: free.text.index(stop)]


def test_completions_endpoint(client, model_name, local_engine):
    tok = local_engine.tokenizer
    want = run_to_completion(local_engine, {"c": (tok.encode("The capital of Italy is"),
                                                  SamplingParams(max_tokens=12, temperature=0))})["c"]
    r = client.completions.create(model=model_name, prompt="The capital of Italy is", max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text


async def _watch_streams(url: str, seen: dict, stop: asyncio.Event) -> None:
    nc = await nats.connect(url)
    async def on(msg):
        d = json.loads(msg.data)
        if d.get("schema") == "StreamChunk":
            seen.setdefault(d["request_id"], set()).add(d["worker"])
    sub = await nc.subscribe("tandem.stream.>", cb=on)
    await stop.wait()
    await sub.unsubscribe()
    await nc.close()


async def _prefill_idle(url: str) -> None:
    """Until the prefill worker has sent two heartbeats in a row holding no request: the router no
    longer counts an earlier test's request there (a short interactive prompt skips a prefill
    worker that holds worse-tier work)."""
    nc = await nats.connect(url)
    sub = await nc.subscribe("tandem.heartbeat.prefill.*")
    quiet = 0
    async with asyncio.timeout(120):   # only catches a hang
        async for msg in sub.messages:
            quiet = 0 if json.loads(msg.data)["requests"] else quiet + 1
            if quiet == 2:
                break
    await nc.close()


def test_tiers_land_on_gpu_and_cpu_decode(stack, nats_server, model_name):
    seen: dict[str, set] = {}

    async def go():
        await _prefill_idle(nats_server)
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch_streams(nats_server, seen, stop))
        await asyncio.sleep(0.3)
        aclient = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
        msgs = [{"role": "user", "content": QUESTION}]
        # one after the other: an interactive prompt that came while the prefill worker held the
        # batch one would be prefilled on gpu-decode (the next test)
        inter = await aclient.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, temperature=0,
                                                      extra_headers={"X-Tandem-SLA": "interactive"})
        batch = await aclient.chat.completions.create(model=model_name, messages=msgs, max_tokens=8, temperature=0,
                                                      extra_headers={"X-Tandem-SLA": "batch"})
        await asyncio.sleep(0.3)
        stop.set()
        await watcher
        return inter, batch

    inter, batch = asyncio.run(go())
    assert inter.choices[0].message.content == batch.choices[0].message.content
    assert any(w.startswith("gpu-decode") for w in seen[inter.id]), seen
    assert any(w.startswith("cpu-decode") for w in seen[batch.id]), seen
    # two-phase: the first token came from the prefill worker
    assert any(w.startswith("prefill") for w in seen[inter.id]), seen


def test_interactive_prompt_skips_a_prefill_worker_busy_with_batch_work(stack, nats_server, model_name,
                                                                       local_engine):
    """While the prefill worker prefills a long batch prompt, a short interactive prompt is
    prefilled on its gpu-decode worker instead of waiting for the batch step in flight there
    (docs/routing.md), with the same greedy answer."""
    question = "Name three primary colours."
    _, want = local_chat(local_engine, question, 8)
    filler = f"{uuid.uuid4().hex} " + "The quick brown fox jumps over the lazy dog. " * 100  # never cached
    events: list[tuple[str, dict]] = []   # (subject kind, message), in the order NATS delivered them

    async def go():
        nc = await nats.connect(nats_server)

        async def on(msg):
            events.append(("plan" if msg.subject == "tandem.router.decision" else "chunk", json.loads(msg.data)))
        await nc.subscribe("tandem.router.decision", cb=on)
        await nc.subscribe("tandem.stream.>", cb=on)
        await nc.flush()
        aclient = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)
        batch = asyncio.create_task(aclient.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": filler}], max_tokens=4, temperature=0,
            extra_headers={"X-Tandem-SLA": "batch"}))
        for _ in range(600):   # the batch request is routed (to the prefill worker)
            if any(kind == "plan" and m.get("tier") == "batch" for kind, m in events):
                break
            await asyncio.sleep(0.05)
        inter = await aclient.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0,
            extra_headers={"X-Tandem-SLA": "interactive"})
        batch = await batch
        await asyncio.sleep(0.3)
        await nc.close()
        return inter, batch

    inter, batch = asyncio.run(go())
    plans = {m["request_id"]: (i, m) for i, (kind, m) in enumerate(events) if kind == "plan" and "request_id" in m}
    assert plans[batch.id][1]["prefill_worker"], plans[batch.id]
    first_batch_chunk = next(i for i, (kind, m) in enumerate(events) if kind == "chunk"
                             and m.get("request_id") == batch.id)
    assert plans[inter.id][0] < first_batch_chunk, "the batch prompt was prefilled before the interactive one came"
    plan = plans[inter.id][1]
    assert plan["prefill_worker"] is None and "prefill workers busy with worse tiers" in plan["reason"], plan
    workers = {m.get("worker") for kind, m in events if kind == "chunk" and m.get("request_id") == inter.id}
    assert workers and all(w.startswith("gpu-decode") for w in workers), workers
    assert inter.choices[0].message.content == want.text
    assert batch.choices[0].finish_reason in ("length", "stop")


def test_client_disconnect_aborts_everywhere(stack, nats_server, model_name):
    aborts: list[str] = []

    async def go():
        nc = await nats.connect(nats_server)
        async def on(msg):
            aborts.append(json.loads(msg.data)["request_id"])
        await nc.subscribe("tandem.abort", cb=on)
        await nc.flush()
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as hc:
            body = {"model": model_name, "stream": True, "max_tokens": 2000, "temperature": 0,
                    "messages": [{"role": "user", "content": "Write a very long essay about the ocean."}]}
            async with hc.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                rid = resp.headers.get("x-request-id")
                n = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        n += 1
                    if n >= 3:
                        break
        # the client is gone: the abort reaches the bus and the workers drop the request
        for _ in range(100):
            if rid in aborts:
                break
            await asyncio.sleep(0.1)
        beats = {}
        async def on_beat(msg):
            d = json.loads(msg.data)
            beats[d["worker_id"]] = d
        await nc.subscribe("tandem.heartbeat.>", cb=on_beat)
        await asyncio.sleep(2.0)
        await nc.close()
        return rid, beats

    rid, beats = asyncio.run(go())
    assert rid in aborts
    decode = [b for b in beats.values() if b["role"].endswith("decode")]
    assert decode and all(b["running"] == 0 for b in decode), decode


def test_bad_requests_get_4xx_and_services_stay_up(stack, client, model_name):
    h = httpx.post(stack.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert h.status_code == 400 and "error" in h.json()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "word " * 9000}],
                                       max_tokens=10)
    assert e.value.code == "context_length_exceeded"
    health = httpx.get(stack.url + "/health")
    assert health.status_code == 200
    pool = health.json()["details"]["kvpool"]          # the KV pool's own heartbeat
    assert pool["ready"] and len(pool["workers"]) == 1, health.json()
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None


def test_embedded_nats_default(tmp_path):
    """With TANDEM_NATS_URL unset, `tandem up` starts its own nats-server and everything works.
    Stopping it: the first Ctrl-C says what it does (drain, then the rest) and drains; a SIGTERM
    then changes nothing (a second forced stop lost the workers' KV write-backs); a second Ctrl-C
    stops everything at once, a stream still going included (it was ignored, silently)."""
    import signal
    import threading
    import time
    s = start_stack(None, ["--gpu-decode", "0", "--prefill", "0"])
    try:
        s.wait_healthy(180)
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        model = c.models.list().data[0].id
        r = c.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        got = []

        def stream() -> None:
            try:
                for chunk in c.completions.create(model=model, prompt="Count:", max_tokens=4000, stream=True,
                                                  extra_body={"ignore_eos": True}):
                    got.append(chunk)
            except Exception as e:     # cut at once by the second Ctrl-C
                got.append(e)
        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert wait(lambda: len(got) > 3, 60)
        s.proc.send_signal(signal.SIGINT)
        assert wait(lambda: any("SIGINT: stopping" in line for line in s.log), 10), s.tail()
        time.sleep(1.0)
        assert s.proc.poll() is None                  # draining: the stream goes on (TANDEM_DRAIN_S 30 s)
        s.proc.send_signal(signal.SIGTERM)            # a second SIGTERM (a script, a manager): still in order
        assert wait(lambda: any("SIGTERM again: already stopping" in line for line in s.log), 10), s.tail()
        time.sleep(1.0)
        assert s.proc.poll() is None and len(got) > 3 and not isinstance(got[-1], Exception)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        s.proc.wait(20)
        assert time.monotonic() - t0 < 15, s.tail()
        assert any("SIGINT again: stopping at once" in line for line in s.log), s.tail()
        t.join(10)
    finally:
        s.stop()
    assert any("embedded NATS accepts only the role credentials" in line for line in s.log)
    assert any("stack stopped" in line for line in s.log)
    assert not bus_denials(s)
