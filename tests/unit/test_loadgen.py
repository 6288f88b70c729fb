"""The load generator: exact statistics on synthetic timings, the workloads, and both loops
against a synthetic SSE server whose timings are known."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import threading
import time

import pytest

from bench.loadgen import (QUESTIONS, Progress, RequestResult, make_jobs, meets_slo, parse_mix, percentile,
                           request_metrics, run_jobs, summarize)

# ---- statistics (pure) ---------------------------------------------------------------------


def test_percentile_exact_values():
    xs = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(xs, 50) == 5.5
    assert percentile(xs, 0) == 1
    assert percentile(xs, 100) == 10
    assert percentile(xs, 99) == pytest.approx(9.91)   # 1 + 0.99 * 9 = 9.91 -> 9 + 0.91
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(list(range(101)), 99) == 99      # order statistics land exactly


def test_percentile_order_and_edge_cases():
    assert percentile([5, 1, 3], 50) == 3              # unsorted input
    assert percentile([7], 99) == 7
    assert percentile([0, 10], 25) == 2.5
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [0.3, 12.0, 4.5, 4.5, 7.25, 100.0, 0.0, 3.0, 9.0]
    for q in (1, 10, 50, 90, 99):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_request_metrics():
    # sent at 10.0; first token at 10.5; 4 more tokens every 0.1 s; stream ends at 11.0
    r = request_metrics(10.0, [10.5, 10.6, 10.7, 10.8, 10.9], 11.0, tokens=5)
    assert r.ok and r.tokens == 5
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.1)
    assert r.itl == pytest.approx([0.1] * 4)
    assert r.latency == pytest.approx(1.0)
    # usage counts more tokens than chunks (a chunk carried two tokens): TPOT uses the tokens
    r2 = request_metrics(0.0, [1.0, 2.0], 2.5, tokens=3)
    assert r2.tpot == pytest.approx(0.5) and r2.tokens == 3
    # no usage chunk: the chunk count stands in
    assert request_metrics(0.0, [1.0, 1.2, 1.4], 1.5, tokens=None).tokens == 3
    assert math.isnan(request_metrics(0.0, [1.0], 1.0, tokens=1).tpot)
    assert not request_metrics(0.0, [], 1.0, tokens=None).ok


def test_summarize_quantiles_throughput_and_goodput():
    rs = [RequestResult(ok=True, tokens=10, ttft=t, tpot=t / 10, itl=[t / 10], latency=2 * t,
                        tier="interactive" if t < 0.3 else "batch") for t in (0.1, 0.2, 0.3, 0.4, 0.5)]
    rs.append(RequestResult(ok=False, error="boom", tier="batch"))
    slos = {"interactive": (150.0, 100.0), "batch": (450.0, 100.0)}
    s = summarize(rs, wall_s=2.0, slos=slos)
    assert s["requests"] == 6 and s["errors"] == 1
    assert s["output_tokens"] == 50
    assert s["throughput_tok_s"] == 25.0
    assert s["ttft_p50_ms"] == pytest.approx(300.0)
    assert s["ttft_p90_ms"] == pytest.approx(460.0)    # 0.4 + 0.6 * 0.1
    assert s["ttft_p99_ms"] == pytest.approx(496.0)    # 0.4 + 0.96 * 0.1
    assert s["tpot_p50_ms"] == pytest.approx(30.0)
    assert s["latency_p50_ms"] == pytest.approx(600.0)
    # within SLO: 0.1 (interactive <= 150 ms), 0.3 and 0.4 (batch <= 450 ms); not 0.2, 0.5, the failure
    assert s["goodput_req_s"] == pytest.approx(1.5) and s["goodput_tok_s"] == pytest.approx(15.0)
    assert s["slo_met"] == pytest.approx(0.5)
    assert list(s["per_tier"]) == ["interactive", "batch"]
    assert s["per_tier"]["interactive"]["requests"] == 2 and s["per_tier"]["interactive"]["slo_met"] == 0.5
    assert s["per_tier"]["batch"]["errors"] == 1 and s["per_tier"]["batch"]["ttft_p50_ms"] == pytest.approx(400.0)


def test_slo_needs_both_bounds():
    slos = {"standard": (100.0, 10.0)}
    assert meets_slo(RequestResult(ok=True, ttft=0.05, tpot=0.01), slos)
    assert not meets_slo(RequestResult(ok=True, ttft=0.05, tpot=0.02), slos)
    assert not meets_slo(RequestResult(ok=True, ttft=0.2, tpot=0.001), slos)
    assert meets_slo(RequestResult(ok=True, ttft=0.05), slos)          # one token: no TPOT
    assert not meets_slo(RequestResult(ok=False), slos)


# ---- workloads -----------------------------------------------------------------------------

def test_chat_and_long_workloads():
    chat = make_jobs("chat", 10, max_tokens=8)
    assert len(chat) == 10 and all(len(j) == 1 for j in chat)
    assert chat[1][0].messages == [{"role": "user", "content": QUESTIONS[1]}]
    long = make_jobs("long", 3, max_tokens=8, long_words=1000)
    assert all(len(j[0].messages[0]["content"].split()) > 1000 for j in long)
    assert make_jobs("long", 3, max_tokens=8, seed=1)[0][0].messages != make_jobs("long", 3, max_tokens=8)[0][0].messages


def test_agent_sessions_grow_and_share_the_system_prompt():
    jobs = make_jobs("agent", 14, max_tokens=8, turns=6, turn_words=200)
    assert [len(j) for j in jobs] == [6, 6, 2]                   # 14 requests in all
    first = jobs[0]
    assert len({r.session for r in first}) == 1 and first[0].session != jobs[1][0].session
    assert len({r.tier for r in first}) == 1                     # a session keeps its tier
    sizes = [sum(len(m["content"].split()) for m in r.messages) for r in first]
    assert sizes == sorted(sizes) and sizes[-1] > 1500          # ~2000+ tokens by the last turn
    for a, b in zip(first, first[1:]):                          # each turn extends the previous one
        assert b.messages[:len(a.messages)] == a.messages
    assert jobs[0][0].messages[0] == jobs[1][0].messages[0]     # one system prompt for all sessions
    assert make_jobs("agent", 14, max_tokens=8) == make_jobs("agent", 14, max_tokens=8)  # deterministic


def test_tier_mix():
    assert parse_mix("interactive=1,batch=3") == {"interactive": 0.25, "batch": 0.75}
    assert parse_mix("batch") == {"batch": 1.0}
    tiers = [j[0].tier for j in make_jobs("chat", 400, max_tokens=1, tiers=parse_mix("interactive=1,batch=3"))]
    assert 0.15 < tiers.count("interactive") / 400 < 0.35 and set(tiers) == {"interactive", "batch"}
    for bad in ("gold=1", "standard=x", "standard=0", "batch=-1"):
        with pytest.raises(ValueError, match="--tiers"):
            parse_mix(bad)
    with pytest.raises(ValueError, match="workload"):
        make_jobs("poetry", 1, max_tokens=1)


# ---- against a synthetic server ------------------------------------------------------------
#
# The server runs in this process (a thread) and stamps, on the same clock as the generator
# (time.perf_counter), when each request arrived and when each chunk left. Causality gives exact
# bounds that hold however loaded the machine is: the generator sent a request before the
# server got it and saw a chunk after the server sent it, so every measured interval is at
# least the server's. Upper bounds come from events too (a closed loop of one sends the next
# request only after the previous reply ended), or are deadlines that only catch a hang.

ITL_S = 0.010
HANG_S = 30.0   # no measured interval is this long unless something hangs


def ttft_of(question: str) -> float:
    """The synthetic server's TTFT for a chat question: 20 ms + 100 ms x its index."""
    return 0.020 + 0.100 * QUESTIONS.index(question)


def synthetic_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    seen: list[dict] = []   # per request, in arrival order: headers, question and the server's stamps

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "synthetic", "object": "model"}]})

    async def chat(request):
        body = await request.json()
        rec = {"tier": request.headers.get("x-tandem-sla"), "session": request.headers.get("x-tandem-session"),
               "question": body["messages"][-1]["content"], "recv": time.perf_counter(), "sent": [], "done": None}
        seen.append(rec)
        delay = ttft_of(rec["question"])
        n = body["max_tokens"]

        async def events():
            await asyncio.sleep(delay)
            for i in range(n):
                if i:
                    await asyncio.sleep(ITL_S)
                rec["sent"].append(time.perf_counter())   # before the chunk leaves: a lower bound
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': f't{i} '}}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 7, 'completion_tokens': n}})}\n\n"
            rec["done"] = time.perf_counter()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
    return app, seen


@pytest.fixture(scope="module")
def synthetic():
    import uvicorn

    from shared.nats_server import free_port

    app, seen = synthetic_app()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the synthetic server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    t.join(5)


def arrivals(r: RequestResult) -> list[float]:
    """The generator's chunk arrival times, seconds after it sent the request."""
    return list(itertools.accumulate(r.itl, initial=r.ttft))


def test_closed_loop_measures_the_known_timings(synthetic):
    url, seen = synthetic
    before = len(seen)
    jobs = make_jobs("chat", 8, max_tokens=5, tiers=parse_mix("interactive"))
    results, wall = asyncio.run(run_jobs(url, jobs, concurrency=8, progress=False))
    assert [r.ok for r in results] == [True] * 8 and all(r.tokens == 5 and r.prompt_tokens == 7 for r in results)
    server = {x["question"]: x for x in seen[before:]}
    assert len(server) == 8 and {x["tier"] for x in server.values()} == {"interactive"}
    server_ttft = []
    for r, q in zip(results, QUESTIONS):
        x = server[q]
        got = arrivals(r)
        assert len(got) == 5 and got == sorted(got)
        for arrived, sent in zip(got, x["sent"]):        # each chunk seen after it was sent...
            assert arrived >= sent - x["recv"]
        assert r.latency >= x["done"] - x["recv"] and r.latency >= got[-1]
        assert got[-1] < HANG_S                          # ...and not absurdly later
        assert r.tpot == pytest.approx((got[-1] - got[0]) / 4)
        server_ttft.append(x["sent"][0] - x["recv"])
        assert server_ttft[-1] >= ttft_of(q) - 0.001     # the server kept its schedule
    want = [ttft_of(q) for q in QUESTIONS]                            # 20, 120, ... 720 ms
    assert percentile(want, 50) * 1e3 == pytest.approx(370.0)        # the exact quantiles of the timings...
    assert percentile(want, 90) * 1e3 == pytest.approx(650.0)
    assert percentile(want, 99) * 1e3 == pytest.approx(713.0)
    s = summarize(results, wall, {"interactive": (200.0, 50.0)})
    for q in (50, 90, 99):                                            # ...bound what the generator measured
        assert s[f"ttft_p{q}_ms"] >= percentile(server_ttft, q) * 1e3 >= percentile(want, q) * 1e3 - 1
        assert s[f"ttft_p{q}_ms"] == pytest.approx(percentile([r.ttft for r in results], q) * 1e3)
    # 220 ms and slower can never meet 200 ms: at most the 20 and 120 ms requests do
    assert s["slo_met"] <= 2 / 8
    assert s["slo_met"] == sum(r.ttft <= 0.2 and r.tpot <= 0.05 for r in results) / 8
    assert wall >= max(want) + 4 * ITL_S


def test_closed_loop_concurrency_overlaps_requests(synthetic):
    url, seen = synthetic
    jobs = make_jobs("chat", 4, max_tokens=1)                        # 20 + 120 + 220 + 320 ms
    want = [ttft_of(j[0].messages[-1]["content"]) for j in jobs]
    before = len(seen)
    one, wall1 = asyncio.run(run_jobs(url, jobs, concurrency=1, progress=False))
    back_to_back = seen[before:]
    four, wall4 = asyncio.run(run_jobs(url, jobs, concurrency=4, progress=False))
    # one stream: each request reaches the server after the previous reply ended; four: all
    # four are sent before any reply ends
    assert all(b["recv"] >= a["done"] for a, b in itertools.pairwise(back_to_back))
    assert max(r.start for r in four) < min(r.start + r.latency for r in four)
    assert wall1 >= sum(want) and wall4 >= max(want)
    # the closed loop's event order bounds each latency from above, exactly: request k was sent
    # after reply k-1 ended and ended before request k+1 arrived
    for k in range(1, 3):
        assert one[k].latency <= back_to_back[k + 1]["recv"] - back_to_back[k - 1]["done"]


def test_agent_turns_run_in_order_with_their_session(synthetic):
    url, seen = synthetic
    jobs = make_jobs("agent", 4, max_tokens=2, turns=2, turn_words=20)
    for j in jobs:  # the synthetic server times requests by their last message: use known questions
        for k, r in enumerate(j):
            r.messages = r.messages[:-1] + [{"role": "user", "content": QUESTIONS[k]}]
    before = len(seen)
    results, _ = asyncio.run(run_jobs(url, jobs, concurrency=2, progress=False))
    assert all(r.ok for r in results) and len(results) == 4
    sessions = [x["session"] for x in seen[before:]]
    assert sorted(sessions) == sorted([jobs[0][0].session] * 2 + [jobs[1][0].session] * 2)
    for job_results in (results[:2], results[2:]):   # turn 2 is sent after turn 1's reply
        assert job_results[1].start >= job_results[0].start + job_results[0].latency - 1e-6


def test_open_loop_poisson_arrivals(synthetic):
    url, seen = synthetic
    jobs = make_jobs("chat", 16, max_tokens=2)
    before = len(seen)
    results, wall = asyncio.run(run_jobs(url, jobs, mode="open", rate=40.0, seed=3, progress=False))
    assert all(r.ok for r in results)
    rng, at = random.Random(3), [0.0]                # the seeded schedule: 15 gaps of mean 25 ms
    for _ in range(15):
        at.append(at[-1] + rng.expovariate(40.0))
    starts = [r.start for r in results]
    assert starts == sorted(starts)                  # arrivals in job order...
    assert all(s >= a - 1e-3 for s, a in zip(starts, at))   # ...none before its time
    assert max(starts) < at[-1] + HANG_S
    # open loop: arrivals do not wait for replies (the server has several requests at once)
    server = seen[before:]
    assert any(b["recv"] < a["done"] for a, b in itertools.pairwise(server))
    with pytest.raises(ValueError):
        asyncio.run(run_jobs(url, jobs, mode="open", rate=0))


def test_failures_are_results(synthetic):
    url, _ = synthetic
    results, _ = asyncio.run(run_jobs(url, make_jobs("chat", 2, max_tokens=2), model="synthetic",
                                      progress=False))
    assert all(r.ok for r in results)
    bad, _ = asyncio.run(run_jobs(url + "/nope", make_jobs("chat", 2, max_tokens=2), model="synthetic",
                                  progress=False))
    assert [r.ok for r in bad] == [False, False] and "HTTP 404" in bad[0].error


def test_progress_bar_into_a_file_writes_tenths():
    import io

    out = io.StringIO()
    bar = Progress(20, "[x]", width=10, stream=out)
    for i in range(20):
        bar.update(ok=i != 3)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and lines[-1].startswith("[x] [##########] 20/20") and lines[-1].endswith("1 failed")
    assert lines[0].startswith("[x] [#.........] 2/20")


def test_bench_serve_against_the_synthetic_server(synthetic, tmp_path, capsys):
    import argparse

    from bench import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--url", synthetic[0], "--mode", "open", "--rate", "20", "40", "--num-requests", "8",
                         "--max-tokens", "3", "--tiers", "interactive=1,batch=1", "--slo", "batch=10000:100",
                         "--warmup", "1", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
    assert serve.main(args) == 0
    out = capsys.readouterr().out
    assert "| server | 20 req/s | 8 |" in out and "| server | 40 req/s | 8 |" in out
    assert "| batch | 10000/100 |" in out
    res = json.loads((tmp_path / "r.json").read_text())
    assert [r["rate"] for r in res["runs"]] == [20.0, 40.0] and res["config"]["slos"]["batch"] == [10000.0, 100.0]
    assert all(r["output_tokens"] == 24 and len(r["per_request"]) == 8 for r in res["runs"])
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_a_url_where_nothing_answers_is_one_clear_error():
    """``tandem bench serve --url`` at a port nobody listens on: a ConnectionError naming the URL
    (the bench prints it as one line and exits 1), not httpx's traceback."""
    import httpx

    from bench.loadgen import served_model
    from shared.nats_server import free_port
    url = f"http://127.0.0.1:{free_port()}"

    async def ask():
        async with httpx.AsyncClient() as client:
            return await served_model(client, url)
    with pytest.raises(ConnectionError, match=f"no OpenAI-compatible server answers at {url}"):
        asyncio.run(ask())


def test_the_load_carries_openai_api_key_and_a_refusal_says_to_set_it(monkeypatch):
    """`tandem bench serve --url` against a gateway with TANDEM_API_KEY[S]: every request was a
    401, and the model lookup a traceback. OPENAI_API_KEY (as the openai client reads it) is sent;
    a 401 says to set it."""
    import httpx

    from bench.loadgen import client_for, served_model
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert "Authorization" not in client_for(1).headers
    monkeypatch.setenv("OPENAI_API_KEY", "k1")
    assert client_for(1).headers["Authorization"] == "Bearer k1"

    def answer(request: httpx.Request) -> httpx.Response:
        if request.headers.get("Authorization") != "Bearer k1":
            return httpx.Response(401, json={"error": {"message": "no key"}})
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    async def lookup(headers):
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), headers=headers) as c:
            return await served_model(c, "http://gw")
    assert asyncio.run(lookup({"Authorization": "Bearer k1"})) == "m"
    with pytest.raises(ConnectionError, match="wants an API key — set OPENAI_API_KEY"):
        asyncio.run(lookup({}))
