"""Live migration between decode workers, in-process on a real NATS server with the real model
and the real data plane: a greedy request moves gpu-decode -> cpu-decode -> gpu-decode mid-
generation and its stream is exactly an unmigrated run's; failed moves leave it running at the
source; bad moves get coded errors; an Abort during a move leaks nothing."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from services.decode import DecodeWorker
from services.migrate import migrate
from shared import subjects
from shared.bus import Bus, RemoteError
from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.sampling import SamplingParams
from shared.nats_server import free_port
from shared.schemas import (Abort, GenerateRequest, Heartbeat, InFlight, Lease, LeaseReply, MigrateRequest, Resume,
                            StreamChunk, Where, WhereReply)
from shared.tier import TIERS
from shared.settings import DataPlaneSettings, NatsSettings, PoolSettings, Settings, WorkerSettings

pytestmark = [pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

PROMPT = ("Write a short essay about the history of the printing press in Europe, from Gutenberg's "
          "workshop in Mainz to the spread of newspapers, and what it changed for ordinary readers.")
LONG_PROMPT = " ".join(f"item {i}," for i in range(120))  # > 512 tokens: prefill takes two steps
MAX_TOKENS = 48


def worker_settings(url: str, worker_id: str, kv_blocks: int) -> Settings:
    return Settings(nats=NatsSettings(url=url), data=DataPlaneSettings(timeout=10.0), pool=PoolSettings(enabled=False),
                    worker=WorkerSettings(worker_id=worker_id, threads=1, kv_blocks=kv_blocks,
                                          heartbeat_interval=0.3, metrics_port=-1))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def workers(nats_server):
    """gpu-decode (on the CPU here), cpu-decode, and a cpu-decode whose KV holds 32 tokens."""
    tag = uuid.uuid4().hex[:6]
    gpu = DecodeWorker(worker_settings(nats_server, f"mig-gpu-{tag}", 96), subjects.GPU_DECODE)
    cpu = DecodeWorker(worker_settings(nats_server, f"mig-cpu-{tag}", 96), subjects.CPU_DECODE)
    tiny = DecodeWorker(worker_settings(nats_server, f"mig-tiny-{tag}", 2), subjects.CPU_DECODE)
    for w in (gpu, cpu, tiny):
        await w.start()
    bus = await Bus.connect(url=nats_server, name="migration-test")
    try:
        for _ in range(100):  # each knows the others' roles (metric labels) from their heartbeats
            if all(all(x.worker_id in w.kv.peers.roles for x in (gpu, cpu, tiny)) for w in (gpu, cpu)):
                break
            await asyncio.sleep(0.1)
        yield gpu, cpu, tiny, bus
    finally:
        await bus.close()
        for w in (gpu, cpu, tiny):
            await w.close()


@pytest.fixture(scope="module")
def reference(bundled_model):
    """Unmigrated greedy runs: prompt -> Completion."""
    engine = Engine(bundled_model, EngineConfig(num_kv_blocks=96))
    tok = engine.tokenizer
    out = {}
    for name, prompt, n in (("short", PROMPT, MAX_TOKENS), ("long", LONG_PROMPT, 8)):
        ids = tok.encode(prompt)
        out[name] = (ids, run_to_completion(engine, {name: (ids, greedy(n))})[name])
    assert len(out["short"][0]) > 32 and len(out["long"][0]) > 512  # more than the tiny KV / one step holds
    return out


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


class Stream:
    """Every message on one request's stream subject, as it arrives."""

    def __init__(self, bus: Bus, rid: str):
        self.bus, self.rid, self.chunks = bus, rid, []
        self.arrived = asyncio.Event()

    async def start(self, worker: DecodeWorker, prompt_ids: list[int], n: int, session: str = "",
                    origin: str = "") -> "Stream":
        self.sub = await self.bus.subscribe(subjects.stream(self.rid))
        self.task = asyncio.create_task(self._collect())
        await self.bus.request(subjects.worker_generate(worker.worker_id), GenerateRequest(
            request_id=self.rid, prompt_token_ids=prompt_ids, sampling=greedy(n).to_dict(), tier="standard",
            stream_subject=subjects.stream(self.rid), session_id=session or None, origin=origin))
        return self

    async def _collect(self) -> None:
        async for msg in self.sub:
            assert isinstance(msg, StreamChunk), msg
            self.chunks.append(msg)
            self.arrived.set()

    async def wait_for(self, pred, timeout: float = 60.0) -> None:
        async def until() -> None:
            while not pred(self.chunks):
                self.arrived.clear()
                await self.arrived.wait()
        await asyncio.wait_for(until(), timeout)

    async def finish(self, timeout: float = 120.0) -> list[StreamChunk]:
        await self.wait_for(lambda cs: any(c.finish_reason for c in cs), timeout)
        await asyncio.sleep(0.3)  # anything published after the finish would show up now
        self.task.cancel()
        await self.sub.unsubscribe()
        return self.chunks


def check_stream(chunks: list[StreamChunk], want) -> None:
    """Seqs 0..n-1 exactly once, one finish chunk (the last), tokens and text as unmigrated."""
    ordered = sorted(chunks, key=lambda c: c.seq)
    assert [c.seq for c in ordered] == list(range(len(chunks)))
    assert [c.finish_reason is not None for c in ordered] == [False] * (len(chunks) - 1) + [True]
    assert [t for c in ordered for t in c.token_ids] == want.token_ids
    assert "".join(c.text for c in ordered) == want.text
    assert ordered[-1].finish_reason == want.finish_reason
    assert ordered[-1].usage["completion_tokens"] == want.num_output_tokens


def move(rid: str, target: DecodeWorker, tier: str = "standard") -> MigrateRequest:
    return MigrateRequest(request_id=rid, target_worker=target.worker_id, target_data_host=target.data_host,
                          target_data_port=target.data_port, tier=tier, reason="test")


async def ghost(bus: Bus, port: int) -> str:
    """A cpu-decode worker that heartbeats a data-plane address on which nothing listens (it died
    after its last heartbeat); its id."""
    wid = f"mig-ghost-{uuid.uuid4().hex[:6]}"
    await bus.publish(subjects.heartbeat(subjects.CPU_DECODE, wid), Heartbeat(
        worker_id=wid, role=subjects.CPU_DECODE, device="cpu", model="m", ready=True, queue_depth=0, running=0,
        free_kv_blocks=96, total_kv_blocks=96, max_context=4096, data_host="127.0.0.1", data_port=port,
        ts=time.time(), interval=60.0))
    return wid


def migrations(source: str, target: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("tandem_migrations_total", {"source_role": source, "target_role": target,
                                                                 "outcome": outcome}) or 0.0


def transfers() -> tuple[float, float]:
    """(transfers, bytes) the data plane has counted in this process, every path together."""
    n = b = 0.0
    for metric in REGISTRY.collect():
        for smp in metric.samples:
            if smp.name == "tandem_transfer_seconds_count":
                n += smp.value
            elif smp.name == "tandem_transfer_bytes_total":
                b += smp.value
    return n, b


def idle(*ws: DecodeWorker) -> bool:
    return all(not w.engine.engine.seqs and not w.held and not w.tasks and not w.moving for w in ws)


async def test_migrate_there_and_back_matches_unmigrated(workers, reference):
    gpu, cpu, _, bus = workers
    ids, want = reference["short"]
    rid = f"mig-{uuid.uuid4().hex[:8]}"
    before = migrations(subjects.GPU_DECODE, subjects.CPU_DECODE, "ok")
    moved_before = transfers()
    s = await Stream(bus, rid).start(gpu, ids, MAX_TOKENS, session="sess-1")
    assert InFlight(rid, "sess-1", "standard") in gpu.heartbeat().requests

    await s.wait_for(lambda cs: len(cs) >= 4)
    there = await migrate(bus, gpu.worker_id, move(rid, cpu, tier="batch"))
    assert (there.source, there.target) == (gpu.worker_id, cpu.worker_id)
    assert 4 <= there.next_seq < MAX_TOKENS and there.nbytes > 0 and there.num_tokens == len(ids) + there.next_seq - 1
    assert rid not in gpu.engine.engine.seqs and rid not in gpu.held
    assert InFlight(rid, "sess-1", "batch") in cpu.heartbeat().requests  # the target holds it, at the new tier
    assert InFlight(rid, "sess-1", "standard") not in gpu.heartbeat().requests
    assert migrations(subjects.GPU_DECODE, subjects.CPU_DECODE, "ok") == before + 1

    await s.wait_for(lambda cs: sum(c.worker == cpu.worker_id for c in cs) >= 4)
    back = await migrate(bus, cpu.worker_id, move(rid, gpu))
    assert (back.source, back.target) == (cpu.worker_id, gpu.worker_id) and back.next_seq > there.next_seq

    chunks = await s.finish()
    check_stream(chunks, want)
    n, nbytes = transfers()  # each move counted once, with its bytes (the pool is off: nothing else moves)
    assert (n - moved_before[0], nbytes - moved_before[1]) == (2, there.nbytes + back.nbytes)
    by_seq = {c.seq: c.worker for c in chunks}
    assert {by_seq[q] for q in range(there.next_seq)} == {gpu.worker_id}
    assert {by_seq[q] for q in range(there.next_seq, back.next_seq)} == {cpu.worker_id}
    assert {by_seq[q] for q in range(back.next_seq, len(chunks))} == {gpu.worker_id}
    await asyncio.sleep(0.2)
    assert idle(gpu, cpu)
    beat = gpu.heartbeat()
    assert beat.tpot_ms > 0 and beat.requests == [] and beat.waiting_by_tier == {t: 0 for t in TIERS}


@pytest.mark.parametrize("failure", ["no_receiver", "target_too_small"])
async def test_failed_move_goes_on_at_the_source(workers, reference, failure):
    gpu, cpu, tiny, bus = workers
    ids, want = reference["short"]
    rid = f"mig-{failure}-{uuid.uuid4().hex[:8]}"
    s = await Stream(bus, rid).start(gpu, ids, MAX_TOKENS)
    await s.wait_for(lambda cs: len(cs) >= 3)
    if failure == "no_receiver":  # a live worker as far as heartbeats tell, but nothing listens on its data port
        req, code, target_role = move(rid, cpu), "unavailable", subjects.CPU_DECODE
        req.target_data_port = free_port()
        req.target_worker = await ghost(bus, req.target_data_port)
    else:  # the target's KV holds 32 tokens, so its context is 32: it refuses the import
        req, code, target_role = move(rid, tiny), "bad_request", subjects.CPU_DECODE
    before = migrations(subjects.GPU_DECODE, target_role, "failed")
    with pytest.raises(RemoteError) as e:
        await migrate(bus, gpu.worker_id, req)
    assert e.value.code == code and "goes on at" in e.value.message
    assert migrations(subjects.GPU_DECODE, target_role, "failed") == before + 1
    chunks = await s.finish()
    check_stream(chunks, want)
    assert {c.worker for c in chunks} == {gpu.worker_id}
    await asyncio.sleep(0.2)
    assert idle(gpu, cpu, tiny)


async def test_a_move_onto_a_full_worker_is_refused_unless_its_source_is_stopping(workers, reference):
    """Every sequence slot of the target taken (two router copies each planned its last one): the
    move is refused (overloaded) and the request goes on at its source, unbroken; a stopping
    source's evacuation goes past the cap (a slower stream beats one cut and resumed)."""
    gpu, cpu, tiny, bus = workers
    ids, want = reference["short"]
    tag, n = uuid.uuid4().hex[:8], 160   # long enough to be running through both moves
    there = await Stream(bus, f"mig-full-a-{tag}").start(cpu, ids, n)
    rid = f"mig-full-b-{tag}"
    s = await Stream(bus, rid).start(gpu, ids, n)
    await there.wait_for(lambda cs: len(cs) >= 3)
    await s.wait_for(lambda cs: len(cs) >= 3)
    sched = cpu.engine.engine.scheduler
    cap, sched.max_num_seqs = sched.max_num_seqs, 1   # its one slot holds the first stream
    try:
        with pytest.raises(RemoteError) as e:
            await migrate(bus, gpu.worker_id, move(rid, cpu))
        assert e.value.code == "overloaded" and "every sequence slot is taken" in e.value.message
        assert "goes on at" in e.value.message and [q.request_id for q in sched.running] == [there.rid]
        gpu.draining = True   # stopping (SIGTERM: ``run_until``): the router evacuates it
        try:
            reply = await migrate(bus, gpu.worker_id, move(rid, cpu))
        finally:
            gpu.draining = False
        assert reply.target == cpu.worker_id and len(sched.running) == 2
    finally:
        sched.max_num_seqs = cap
    for stream, workers_seen in ((s, {gpu.worker_id, cpu.worker_id}), (there, {cpu.worker_id})):
        chunks = sorted(await stream.finish(), key=lambda c: c.seq)
        assert [c.seq for c in chunks] == list(range(len(chunks))) and chunks[-1].finish_reason == "length"
        tokens = [t for c in chunks for t in c.token_ids]
        assert len(tokens) == n and tokens[:MAX_TOKENS] == want.token_ids   # greedy: the 48-token run's start
        assert {c.worker for c in chunks} == workers_seen


async def test_bad_moves_get_coded_errors(workers, reference):
    gpu, cpu, tiny, bus = workers
    with pytest.raises(RemoteError) as e:
        await migrate(bus, gpu.worker_id, move("no-such-request", cpu))
    assert e.value.code == "not_found"

    ids, want = reference["long"]  # 512 tokens per step: after the first chunk it is still prefilling
    rid = f"mig-prefill-{uuid.uuid4().hex[:8]}"
    s = await Stream(bus, rid).start(gpu, ids, 8)
    with pytest.raises(RemoteError) as e:
        await migrate(bus, gpu.worker_id, move(rid, cpu))
    assert e.value.code == "unavailable" and "not decoding yet" in e.value.message
    same = await migrate(bus, gpu.worker_id, move(rid, gpu, "batch"))   # onto its own worker: re-tiered there
    assert (same.source, same.target, same.path, same.num_tokens) == (gpu.worker_id, gpu.worker_id, "in place", 0)
    assert gpu.requests[rid].tier == "batch" and gpu.engine.engine.seqs[rid].priority == 2
    before = migrations(subjects.GPU_DECODE, subjects.CPU_DECODE, "failed")
    elsewhere = move(rid, cpu)   # its KV to an address no live worker's heartbeat names: refused
    elsewhere.target_data_port = free_port()
    other = move(rid, cpu)       # to a live worker's data plane, but not the target worker's
    other.target_worker = tiny.worker_id
    for req in (elsewhere, other):
        with pytest.raises(RemoteError) as e:
            await migrate(bus, gpu.worker_id, req)
        assert e.value.code == "forbidden" and "refusing to send" in e.value.message
    assert migrations(subjects.GPU_DECODE, subjects.CPU_DECODE, "failed") == before  # nothing was moved
    chunks = await s.finish()
    check_stream(chunks, want)
    assert {c.worker for c in chunks} == {gpu.worker_id}


# when the Abort is published: with the MigrateRequest; once the source's stream has drained
# (parked, KV on its way); once the target took it (the source may not have settled yet)
MOMENTS = {"at_once": lambda rid, src, dst: True,
           "while_sending": lambda rid, src, dst: rid in src.moving and rid not in src.tasks,
           "target_has_it": lambda rid, src, dst: rid in dst.held}


@pytest.mark.parametrize("moment", list(MOMENTS))
async def test_abort_during_a_move_leaks_nothing(workers, reference, moment):
    gpu, cpu, _, bus = workers
    ids, _ = reference["short"]
    rid = f"mig-abort-{uuid.uuid4().hex[:8]}"
    s = await Stream(bus, rid).start(gpu, ids, 1000)  # a leaked copy would run for many seconds
    await s.wait_for(lambda cs: len(cs) >= 2)
    moving = asyncio.create_task(migrate(bus, gpu.worker_id, move(rid, cpu)))
    for _ in range(5000):
        if MOMENTS[moment](rid, gpu, cpu):
            break
        await asyncio.sleep(0.001)
    else:
        pytest.fail(f"the move never reached {moment}")
    await bus.publish(subjects.ABORT, Abort(request_id=rid, reason="test"))
    try:
        await moving
    except RemoteError as e:
        assert e.code == "not_found", e
    for _ in range(30):  # wherever it was when the Abort came, it ends everywhere
        if idle(gpu, cpu):
            break
        await asyncio.sleep(0.1)
    assert idle(gpu, cpu), (gpu.engine.engine.seqs, cpu.engine.engine.seqs, gpu.held, cpu.held)
    n = len(s.chunks)
    await asyncio.sleep(0.5)
    assert len(s.chunks) == n and sum(len(c.token_ids) for c in s.chunks) < 100  # nothing ran on
    s.task.cancel()
    await s.sub.unsubscribe()


async def test_the_requests_of_a_dead_gateway_are_dropped(workers, reference, nats_server):
    """A worker asks the gateway its requests stream to whether it still runs (its lease); once
    nobody answers, the request is aborted and its KV freed — no generation runs on for nobody."""
    _, cpu, _, bus = workers
    ids, _ = reference["short"]
    gw = await Bus.connect(url=nats_server, name="lease-gateway")
    async def alive(lease: Lease) -> LeaseReply:  # it waits for every request it is asked about
        return LeaseReply(gateway="gw-lease", attempts=dict(lease.requests))
    await gw.serve(subjects.gateway_alive("gw-lease"), alive, expected=Lease)
    rid = f"lease-{uuid.uuid4().hex[:8]}"
    s = await Stream(bus, rid).start(cpu, ids, 4000, origin="gw-lease")
    try:
        await s.wait_for(lambda cs: len(cs) >= 3)
        await asyncio.sleep(1.5)                      # leases checked while the gateway lives: it goes on
        assert rid in cpu.held
        await gw.close()                              # the gateway dies
        for _ in range(100):
            if idle(cpu):
                break
            await asyncio.sleep(0.1)
        assert idle(cpu), (cpu.engine.engine.seqs, cpu.held)
        assert not any(c.finish_reason == "length" for c in s.chunks)
    finally:
        s.task.cancel()
        await s.sub.unsubscribe()


async def test_a_resume_that_comes_while_the_older_attempt_is_admitted(workers, reference):
    """The gateway got no ack in time for attempt 0 (the engine was inside a long step) and resumed
    the request, to the same worker, while attempt 0 was still being admitted there: attempt 1
    waits for that admission, supersedes it and streams the undisturbed text, and meanwhile Where
    says the worker holds it. (The two once collided in the engine — "request id ... is already
    in the engine", a 400 → worker_lost; once serialised, attempt 1's stream, opened while the
    engine thread was inside a step with attempt 0, got attempt 0's token of that step — a token
    twice: a drifted text — or its "abort" a step later.)"""
    gpu, _, _, bus = workers
    ids, want = reference["short"]
    busy = await Stream(bus, f"mig-busy-{uuid.uuid4().hex[:8]}").start(gpu, reference["long"][0], 8)
    rid = f"mig-twice-{uuid.uuid4().hex[:8]}"
    s = Stream(bus, rid)
    s.sub = await bus.subscribe(subjects.stream(rid))
    s.task = asyncio.create_task(s._collect())

    def attempt(k: int) -> GenerateRequest:
        return GenerateRequest(request_id=rid, prompt_token_ids=ids, sampling=greedy(MAX_TOKENS).to_dict(),
                               tier="standard", stream_subject=subjects.stream(rid), session_id=None,
                               resume=Resume(output_token_ids=[], emitted_chars=0, next_seq=0, attempt=k) if k else None)
    first = asyncio.create_task(bus.request(subjects.worker_generate(gpu.worker_id), attempt(0)))
    while rid not in gpu.admitting and not first.done():
        await asyncio.sleep(0.001)
    if rid in gpu.admitting:   # still inside the long step's wait: the case at hand
        where = await bus.request(subjects.worker_where(gpu.worker_id), Where(request_id=rid), expected=WhereReply)
        assert where.holds and where.attempt == 0
    await asyncio.gather(first, bus.request(subjects.worker_generate(gpu.worker_id), attempt(1)))
    await s.wait_for(lambda cs: any(c.finish_reason and c.attempt == 1 for c in cs))
    chunks = [c for c in await s.finish() if c.attempt == 1]
    check_stream(chunks, want)
    await busy.finish()
    await asyncio.sleep(0.2)
    assert idle(gpu)
