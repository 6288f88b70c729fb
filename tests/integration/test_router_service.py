"""Router copies on a real NATS server: consistent decisions, session tiers, admission control,
and the prefix index after a restart. The workers are heartbeats this test publishes (the
routing decisions are the subject here; tests/e2e/ run real workers)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from kvpool.keys import chunk_keys_from_seed
from shared import subjects
from shared.bus import Bus, RemoteError
from shared.nats_server import EmbeddedNats
from shared.schemas import Heartbeat, KVEvent, RoutePlan, RouteRequest, SessionState, SessionUpdate
from shared.settings import NatsSettings, RouterSettings, Settings, WorkerSettings
from services.router import Router

SEED = "ab" * 32
CHUNK = 16


@pytest.fixture
def nats_url():
    """A server of our own: the prefix index's JetStream stream starts empty."""
    server = EmbeddedNats()
    url = server.start()
    yield url
    server.stop()


def settings(url: str, wid: str, **router) -> Settings:
    return Settings(nats=NatsSettings(url=url),
                    worker=WorkerSettings(worker_id=wid, heartbeat_interval=0.2, metrics_port=-1),
                    router=RouterSettings(**router))


def beat(wid: str, role: str, **kw) -> Heartbeat:
    d = dict(worker_id=wid, role=role, device="cpu", model="m", ready=True, queue_depth=0, running=0,
             free_kv_blocks=100, total_kv_blocks=100, max_context=4096, data_host="127.0.0.1", data_port=9000,
             ts=time.time(), interval=5.0, kv_scope=SEED, chunk_tokens=CHUNK)
    d.update(kw)
    return Heartbeat(**d)


def req(rid: str, tier="standard", session=None, tokens=(1, 2, 3)) -> RouteRequest:
    return RouteRequest(request_id=rid, model="m", tier=tier, session_id=session, num_prompt_tokens=len(tokens),
                        max_tokens=8, prompt_token_ids=list(tokens))


async def until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def start(url, *beats, **router):
    """A test bus (publishing ``beats``) and the routers named in ``router["ids"]``."""
    ids = router.pop("ids", ("router-a",))
    bus = await Bus.connect(Settings(nats=NatsSettings(url=url)), name="test")
    routers = []
    for rid in ids:
        r = Router(settings(url, rid, **router))
        await r.start()
        routers.append(r)
    for b in beats:
        await bus.publish(subjects.heartbeat(b.role, b.worker_id), b)
    await until(lambda: all(len(r.workers) >= len(beats) for r in routers))
    return bus, routers


async def stop(bus, routers):
    for r in routers:
        await r.close()
    await bus.close()


async def test_router_copies_share_load_and_sessions(nats_url):
    bus, (a, b) = await start(nats_url, beat("c1", subjects.CPU_DECODE), beat("c2", subjects.CPU_DECODE),
                              beat("g1", subjects.GPU_DECODE), ids=("router-a", "router-b"))
    try:
        # load: a's decision reaches b, so b does not send its request to the same idle worker
        first = await a.route(req("r1"))
        await until(lambda: sum(b.workers[first.decode_worker].pending.values()) == 1)
        second = await b.route(req("r2"))
        assert {first.decode_worker, second.decode_worker} == {"c1", "c2"}
        # affinity: the session's turns stay on its worker whichever copy routes them
        turn1 = await a.route(req("r3", session="s1"))
        await until(lambda: "s1" in b.sessions and b.sessions["s1"].worker == turn1.decode_worker)
        turn2 = await b.route(req("r4", session="s1"))
        assert turn2.decode_worker == turn1.decode_worker and "affinity" in turn2.reason
        # a session's tier set through one copy holds in the other
        state = await bus.request(subjects.ROUTER_SESSION, SessionUpdate(session_id="s1", tier="interactive"),
                                  expected=SessionState)
        assert state.tier == "interactive"
        await until(lambda: a.sessions["s1"].tier == "interactive" and b.sessions["s1"].tier == "interactive")
        turn3 = await b.route(req("r5", "batch", session="s1"))
        assert (turn3.decode_worker, turn3.tier) == ("g1", "interactive")
    finally:
        await stop(bus, [a, b])


async def test_decisions_are_published_for_tap(nats_url):
    bus, routers = await start(nats_url, beat("c1", subjects.CPU_DECODE))
    try:
        sub = await bus.subscribe(subjects.ROUTER_DECISION, RoutePlan, skip_invalid=True)
        plan = await bus.request(subjects.ROUTE, req("r1", session="s9"), expected=RoutePlan)
        seen = await sub.next(timeout=5)
        assert (seen.request_id, seen.decode_worker, seen.session_id, seen.router) == \
               ("r1", plan.decode_worker, "s9", "router-a")
    finally:
        await stop(bus, routers)


async def test_full_tier_queue_gets_overloaded_with_retry_after(nats_url):
    flooded = beat("c1", subjects.CPU_DECODE, running=4, queue_depth=3, waiting_by_tier={"batch": 3},
                   tpot_ms=40.0)
    bus, routers = await start(nats_url, flooded, beat("g1", subjects.GPU_DECODE), queue_batch=3)
    try:
        with pytest.raises(RemoteError) as e:
            await bus.request(subjects.ROUTE, req("r1", "batch"), expected=RoutePlan)
        assert e.value.code == "overloaded" and e.value.retry_after >= 1
        plan = await bus.request(subjects.ROUTE, req("r2", "interactive"), expected=RoutePlan)
        assert plan.decode_worker == "g1"   # other tiers still get in
    finally:
        await stop(bus, routers)


async def test_restarted_router_knows_the_cached_prefixes(nats_url):
    prompt = list(range(100, 100 + 5 * CHUNK))
    keys = chunk_keys_from_seed(SEED, CHUNK, prompt)
    c1, c2 = beat("c1", subjects.CPU_DECODE), beat("c2", subjects.CPU_DECODE)
    bus, (a,) = await start(nats_url, c1, c2)
    await bus.publish(subjects.kv_events("c2"), KVEvent(holder="c2", role=subjects.CPU_DECODE, epoch=1, seq=1,
                                                         stored=keys[:3]))
    await until(lambda: a.cached(prompt)[0].get("c2") == 3 * CHUNK)
    await stop(bus, [a])
    # events while no router runs are replayed from the stream
    bus = await Bus.connect(Settings(nats=NatsSettings(url=nats_url)), name="test")
    await bus.publish(subjects.kv_events("c2"), KVEvent(holder="c2", role=subjects.CPU_DECODE, epoch=1, seq=2,
                                                         stored=keys[3:4]))
    await bus.close()
    bus, (b,) = await start(nats_url, c1, c2, ids=("router-b",))
    try:
        assert b.cached(prompt)[0] == {"c2": 4 * CHUNK}
        plan = await b.route(req("r1", tokens=prompt))
        assert (plan.decode_worker, plan.cached_tokens, plan.cached_at) == ("c2", 4 * CHUNK, "c2")
    finally:
        await stop(bus, [b])


async def test_a_new_router_copy_takes_over_the_session_table(nats_url):
    """The session table lives in JetStream: a router that starts after the one that made the
    decisions died (and after a NATS restart on the same store) keeps each session's tier and home."""
    c1, c2, g1 = beat("c1", subjects.CPU_DECODE), beat("c2", subjects.CPU_DECODE), beat("g1", subjects.GPU_DECODE)
    bus, (a,) = await start(nats_url, c1, c2, g1)
    home = (await a.route(req("r1", session="agent-7"))).decode_worker
    await bus.request(subjects.ROUTER_SESSION, SessionUpdate(session_id="agent 8/ü", tier="interactive"),
                      expected=SessionState)  # any visible id, spaces and slashes included
    await stop(bus, [a])
    bus, (b,) = await start(nats_url, c1, c2, g1, ids=("router-b",))
    try:
        assert b.sessions["agent-7"].worker == home and b.sessions["agent 8/ü"].tier == "interactive"
        plan = await b.route(req("r2", "batch", session="agent 8/ü"))
        assert (plan.decode_worker, plan.tier) == ("g1", "interactive")
        assert (await b.route(req("r3", session="agent-7"))).decode_worker == home
    finally:
        await stop(bus, [b])


async def test_routes_avoid_workers_excluded_by_the_gateway(nats_url):
    bus, routers = await start(nats_url, beat("c1", subjects.CPU_DECODE), beat("c2", subjects.CPU_DECODE))
    try:
        for i in range(4):  # a worker the gateway found dead is never planned for that request
            r = req(f"r{i}")
            r.exclude = ["c1"]
            assert (await bus.request(subjects.ROUTE, r, expected=RoutePlan)).decode_worker == "c2"
    finally:
        await stop(bus, routers)


async def test_tenants_see_only_their_cached_prefixes_and_sessions(nats_url):
    """The prefix index answers a request with its own tenant's keys only; a session is its
    creator's in every router copy: another owner's update is not_found, its request runs without it."""
    prompt = list(range(100, 100 + 3 * CHUNK))
    bus, (a, b) = await start(nats_url, beat("c1", subjects.CPU_DECODE), beat("c2", subjects.CPU_DECODE),
                              ids=("router-a", "router-b"))
    try:
        await bus.publish(subjects.kv_events("c2"), KVEvent(holder="c2", role=subjects.CPU_DECODE, epoch=1, seq=1,
                                                             stored=chunk_keys_from_seed(SEED, CHUNK, prompt,
                                                                                         tenant="t-alice")))
        await until(lambda: a.cached(prompt, "t-alice")[0].get("c2") == 2 * CHUNK)
        assert a.cached(prompt, "t-bob")[0] == {} and a.cached(prompt)[0] == {}
        plan = await a.route(dataclasses.replace(req("r1", tokens=prompt), tenant="t-alice", owner="alice"))
        assert (plan.decode_worker, plan.cached_tokens) == ("c2", 2 * CHUNK)
        await a.route(dataclasses.replace(req("r2", session="s1"), owner="alice"))
        await until(lambda: "s1" in b.sessions and b.sessions["s1"].owner == "alice")
        with pytest.raises(RemoteError) as e:
            await bus.request(subjects.ROUTER_SESSION, SessionUpdate(session_id="s1", tier="batch", owner="bob"),
                              expected=SessionState)
        assert e.value.code == "not_found"
        state = await bus.request(subjects.ROUTER_SESSION, SessionUpdate(session_id="s1", tier="batch", owner="alice"),
                                  expected=SessionState)
        assert state.tier == "batch"
        bobs = await b.route(dataclasses.replace(req("r3", "interactive", session="s1"), owner="bob"))
        assert bobs.session_id is None and bobs.tier == "interactive"   # not in alice's session, nor at its tier
        await until(lambda: b.sessions["s1"].tier == "batch")
    finally:
        await stop(bus, [a, b])
