"""Ring decode (shared/engine/ring.py) on the bundled model, members in this process.

A prompt of 1,520 tokens (6 attention segments of 256) is prefilled once by a single engine
(a prefill worker) and handed off as its KV blob; rings of 2 and 3 members continue it and must
give bitwise the single engine's logits at every step, and its greedy tokens."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from kernels import cpu
from kernels.cpu_ring import SEG, RingKernels
from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.kv_cache import KV_DTYPE, KVBlobHeader
from shared.engine.model import AttnChunk, StepContext
from shared.engine.ring import Ring, RingCapacityError, RingMember
from shared.strategy import shard_ranges
from tests.integration.test_engine import greedy

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the C++ kernels did not build here")

PROMPT_TOKENS = 1520   # + the first token and NEW: 6 segments of 256
NEW = 8   # decode steps compared


@pytest.fixture(scope="module")
def big(bundled_model) -> Engine:
    """A single worker whose KV budget holds the whole session."""
    return Engine(bundled_model, EngineConfig(num_kv_blocks=160, threads=2))


@pytest.fixture(scope="module")
def kernels(big) -> RingKernels:
    k = RingKernels.of(big.model)
    assert k is not None
    return k


@pytest.fixture(scope="module")
def prompt(big) -> list[int]:
    text = (Path(__file__).parents[2] / "docs" / "kernels.md").read_text()
    ids = big.tokenizer.encode(text)[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    return ids


@pytest.fixture(scope="module")
def handoff(big, prompt) -> bytes:
    """The prefill's KV blob (prompt computed, first token sampled), as a prefill worker hands it off."""
    big.add("pre", prompt, greedy(NEW + 1), prefill_only=True)
    while True:
        outs = big.step()
        if any(o.request_id == "pre" and o.finished for o in outs):
            break
    return big.export_kv("pre")


@pytest.fixture(scope="module")
def single(big, handoff) -> tuple[list[int], list[torch.Tensor], bytes]:
    """The single worker's greedy continuation of the hand-off: tokens, each step's logits (its
    fused forward step over its own paged KV: the code ``Engine.step`` runs) and the KV after."""
    h, kv = KVBlobHeader.parse(handoff)
    bs, n = big.layout.block_size, h.num_computed
    blocks = big.blocks.allocate(big.layout.blocks_for(n + NEW))
    table = torch.tensor(blocks)
    toks, logits, seq = [], [], list(h.token_ids)
    try:
        with torch.inference_mode():
            big.kv[table[:big.layout.blocks_for(n)]] = torch.frombuffer(bytearray(kv), dtype=torch.uint8).view(
                KV_DTYPE).view(-1, *big.layout.block_shape)
            for p in range(n, n + NEW):
                pos = torch.tensor([p])
                ctx = StepContext(pos, table[pos // bs], pos % bs, [AttnChunk(p, 1, 0, table)], torch.tensor([0]))
                lg = big.model.forward(torch.tensor([seq[p]]), ctx, big.kv)
                seq.append(int(lg[0].argmax()))
                toks.append(seq[-1])
                logits.append(lg)
        gathered = big.read_blocks(blocks[:big.layout.blocks_for(n + NEW)])
    finally:
        big.blocks.release(blocks)
    return toks, logits, gathered


def by_position(layout, raw: bytes, n: int) -> torch.Tensor:
    """The KV of positions 0..n-1 of whole blocks ``raw``: [n, layers, 2, nkv, hd]."""
    kv = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(KV_DTYPE).view(-1, *layout.block_shape)
    return kv.permute(0, 3, 1, 2, 4, 5).flatten(0, 1)[:n]


async def decodes_as_single(ring: Ring, sid: str, single) -> None:
    """``NEW`` greedy steps of ``sid`` on ``ring``: the single worker's tokens, every logit bitwise."""
    import asyncio
    toks, logits = await asyncio.to_thread(ring.generate, sid, NEW)
    assert toks == single[0]
    for i, (x, y) in enumerate(zip(logits, single[1])):
        assert torch.equal(x, y), f"step {i}: max |diff| {(x - y).abs().max().item()}"


async def holds_single_kv(ring: Ring, sid: str, layout, single, prompt_tokens: int) -> None:
    """The KV the ring's members hold for ``sid``, gathered: the single worker's, position by position."""
    import asyncio
    n = prompt_tokens - 1 + NEW
    gathered = await asyncio.to_thread(ring.gather, sid)
    assert torch.equal(by_position(layout, gathered, n), by_position(layout, single[2], n))


def member_budget(layout, tokens: int) -> int:
    return layout.blocks_for(tokens) * layout.block_bytes


@pytest.mark.parametrize("n_members, fold", [(2, False), (3, False), (3, True)])
def test_ring_decode_is_bitwise_the_single_worker(big, kernels, handoff, single, n_members, fold):
    """Every segment's state back to the coordinator, or folded along the ring: the same bits."""
    toks, logits, kv_after = single
    members = [RingMember(kernels, big.layout, member_budget(big.layout, 1024), f"m{i}") for i in range(n_members)]
    ring = Ring(kernels, members, fold=fold)
    ranges = ring.admit_blob("s", handoff, NEW)
    assert all(a % SEG == 0 for a, _ in ranges) and len(ranges) == n_members
    got_toks, got_logits = ring.generate("s", NEW)
    assert got_toks == toks
    for i, (a, b) in enumerate(zip(got_logits, logits)):
        assert torch.equal(a, b), f"step {i}: max |diff| {(a - b).abs().max().item()}"
    # the tail member appended the new tokens' KV in place (slots past them are unwritten)
    n = len(KVBlobHeader.parse(handoff)[0].token_ids) - 1 + NEW
    assert torch.equal(by_position(big.layout, ring.gather("s"), n), by_position(big.layout, kv_after, n))
    ring.release("s")
    assert all(m.blocks.num_free == m.blocks.num_blocks for m in members)


def test_greedy_tokens_are_the_engine_s(big, prompt, single):
    """The reference loop above is the engine: its full request path gives the same tokens."""
    out = run_to_completion(big, {"full": (prompt, greedy(NEW + 1))})["full"]
    assert out.token_ids[1:] == single[0]


def test_capacity_ring_of_3_serves_what_one_worker_refuses(bundled_model, big, kernels, handoff, single):
    """Per-worker KV budget of ~a third of the session: one worker refuses it with a clear
    reason, a ring of 2 cannot place it (naming the member and the shortfall, keeping nothing),
    a ring of 3 serves it with the single big worker's output."""
    layout = big.layout
    h, _ = KVBlobHeader.parse(handoff)
    total = len(h.token_ids) + NEW
    third = max(b - a for a, b in shard_ranges(total, 3))
    assert third < total / 2.5
    budget = member_budget(layout, third)
    small = Engine(bundled_model, EngineConfig(kv_cache_bytes=budget, threads=2))
    with pytest.raises(ValueError, match="does not fit the context"):
        small.add("r", h.prompt_token_ids, greedy(NEW))
    with pytest.raises(ValueError, match="exceeds this engine's context"):
        small.import_kv("r", handoff)
    two = Ring(kernels, [RingMember(kernels, layout, budget, f"m{i}") for i in range(2)])
    with pytest.raises(RingCapacityError, match=r"m0: tokens \[0, \d+\) need \d+ KV blocks"):
        two.admit_blob("s", handoff, NEW)
    assert all(m.blocks.num_free == m.blocks.num_blocks for m in two.members) and not two.sessions
    three = Ring(kernels, [RingMember(kernels, layout, budget, f"m{i}") for i in range(3)])
    three.admit_blob("s", handoff, NEW)
    assert three.generate("s", NEW)[0] == single[0]


def test_merge_of_random_shards_in_fixed_order_is_exact(big, kernels):
    """Random KV, random SEG-aligned shard boundaries, members computing in random order and at
    scattered block ids, 1 to 3 threads: merged in segment order (by the coordinator, or folded
    along the ring), the layer output is bitwise the one-member ring's (which the test above ties
    to the fused step)."""
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    layout, n = big.layout, 1500                        # 6 segments, the last partial
    kv = (torch.randn(layout.blocks_for(n), *layout.block_shape, generator=gen) * 2).to(KV_DTYPE)
    raw = kv.view(torch.uint8).numpy().tobytes()
    x0 = torch.randn(1, kernels.cfg.hidden_size, generator=gen)
    layer = 3
    ref_qkv = kernels.qkv(layer, x0, n - 1)

    def run(bounds: list[int], order: list[int], fold: bool = False, groups: int = 0) -> torch.Tensor:
        members = []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            m = RingMember(kernels, layout, member_budget(layout, 4096), f"m{i}")
            m.blocks.allocate(rng.randrange(0, 40))     # the shard lands at other block ids
            m.reserve("s", a, b)
            m.load("s", raw[a // layout.block_size * layout.block_bytes:layout.blocks_for(b) * layout.block_bytes])
            members.append(m)
        arrived = {i: members[i].attend("s", layer, ref_qkv, n - 1) for i in order}
        x = x0.clone()
        if groups:   # along the ring head group by head group: each group attended and folded on its own
            nkv = kernels.cfg.n_kv_heads
            states = []
            for g in range(groups):
                heads = (g * nkv // groups, (g + 1) * nkv // groups)
                state = None
                for i in range(len(members)):
                    p = members[i].attend("s", layer, ref_qkv, n - 1, heads)
                    assert torch.equal(p, arrived[i][heads[0]:heads[1]])   # the same states, head by head
                    state = kernels.fold(p if state is None else torch.cat([state, p], dim=1), n - 1, 1, heads)
                states.append(state)
            kernels.merge_ffn(layer, x, ref_qkv, n - 1, torch.cat(states, dim=0), folded=True)
        elif fold:   # along the ring, in shard order
            state = None
            for i in range(len(members)):
                state = kernels.fold(arrived[i] if state is None else torch.cat([state, arrived[i]], dim=1), n - 1, 1)
            kernels.merge_ffn(layer, x, ref_qkv, n - 1, state, folded=True)
        else:
            kernels.merge_ffn(layer, x, ref_qkv, n - 1, torch.cat([arrived[i] for i in range(len(members))], dim=1))
        return x

    one = run([0, n], [0])
    for _ in range(4):
        k = rng.randint(2, 5)
        cuts = sorted(rng.sample(range(1, 6), k - 1))
        order = list(range(k))
        rng.shuffle(order)
        assert torch.equal(run([0, *(c * SEG for c in cuts), n], order), one), cuts
        assert torch.equal(run([0, *(c * SEG for c in cuts), n], order, fold=True), one), cuts
        assert torch.equal(run([0, *(c * SEG for c in cuts), n], order, groups=rng.randint(2, 3)), one), cuts
    try:   # members and coordinator on other thread counts: the same bits
        for t in (1, 3):
            cpu.set_num_threads(t)
            assert torch.equal(run([0, 2 * SEG, n], [1, 0]), one), t
            assert torch.equal(run([0, 2 * SEG, n], [0, 1], fold=True), one), t
    finally:
        cpu.set_num_threads(2)
    # a part out of segment order is a different fold: the order is what makes it exact
    members_parts = RingMember(kernels, layout, member_budget(layout, 2048), "all")
    members_parts.reserve("s", 0, n)
    members_parts.load("s", raw)
    parts = members_parts.attend("s", layer, ref_qkv, n - 1)
    x = x0.clone()
    kernels.merge_ffn(layer, x, ref_qkv, n - 1, parts.flip(1).contiguous())
    assert not torch.equal(x, one)
    for bad in [(0, 0), (2, 1), (0, kernels.cfg.n_kv_heads + 1), (-1, 1)]:
        with pytest.raises(ValueError, match="kv heads"):
            members_parts.attend("s", layer, ref_qkv, n - 1, bad)


def test_scatter_then_gather_gives_the_bytes_back(big, kernels):
    layout, n = big.layout, 1300
    gen = torch.Generator().manual_seed(3)
    raw = torch.randn(layout.blocks_for(n), *layout.block_shape, generator=gen).to(KV_DTYPE)
    raw = raw.view(torch.uint8).numpy().tobytes()
    ring = Ring(kernels, [RingMember(kernels, layout, member_budget(layout, 1024), f"m{i}") for i in range(3)])
    ranges = ring.admit("s", list(range(n + 1)), n, raw, n + 100)
    assert ranges == [(0, 512), (512, 1024), (1024, n + 100)]
    assert [len(m.read("s", n)) // layout.block_bytes for m in ring.members] == [32, 32, 18]
    assert ring.gather("s") == raw
    with pytest.raises(ValueError, match="not the 82 blocks"):
        ring.admit("t", list(range(n + 1)), n, raw[:-1], n + 100)
    assert "t" not in ring.sessions
    # a member whose whole range lies past the computed positions loads nothing yet
    short = layout.blocks_for(400) * layout.block_bytes
    assert ring.admit("u", list(range(401)), 400, raw[:short], 1100) == [(0, 512), (512, 1024), (1024, 1100)]
    assert ring.gather("u") == raw[:short]


def test_bad_ring_inputs_are_refused(big, kernels):
    x = torch.zeros(1, kernels.cfg.hidden_size)
    with pytest.raises(ValueError, match="ring step"):
        kernels.qkv(0, torch.zeros(kernels.max_tokens + 1, kernels.cfg.hidden_size), 0)
    with pytest.raises(ValueError, match="layer"):
        kernels.qkv(kernels.cfg.n_layers, x, 0)
    qkv = kernels.qkv(0, x, 300)
    m = RingMember(kernels, big.layout, member_budget(big.layout, 512), "m")
    m.reserve("s", 0, 512)
    with pytest.raises(ValueError, match="parts must be"):
        kernels.merge_ffn(0, x, qkv, 300, torch.zeros(kernels.cfg.n_kv_heads, 1, kernels.part_floats(1)))
    with pytest.raises(ValueError, match="block table must cover"):
        kernels.attend(0, qkv, 300, m.kv, m.shards["s"].table[:3], 0, 2)
    with pytest.raises(ValueError, match="outside the shard"):
        m.store("s", 0, qkv, 600)
    with pytest.raises(ValueError, match="bad shard"):
        m.reserve("t", 100, 600)


# ---- members in other workers: the per-step messages over a data-plane connection ----------

@pytest.fixture
def two_workers(bundled_model):
    """Two cpu-decode workers' engines: ``a`` coordinates, ``b`` hosts a member on its ring port
    (both share their engine's KV cache with their member); the data-plane key is on."""
    from shared.engine.async_engine import AsyncEngine
    from shared.engine.ring_net import EngineMember, RingServer
    engines = [AsyncEngine(Engine(bundled_model, EngineConfig(num_kv_blocks=64, threads=1))) for _ in range(2)]
    a, b = engines
    mb = EngineMember(b.engine, b.run_blocking, "b")
    server = RingServer(mb, "127.0.0.1", 0, key=b"data-key")
    server.start()
    yield a, b, server
    server.close()
    for e in engines:
        e.engine.seqs.clear()


def ring_of(a, server, key=b"data-key", shm=True, fold=False):
    from shared.engine.ring_net import EngineMember, connect_ring
    ma = EngineMember(a.engine, a.run_blocking, "a")
    plan = [["a", "127.0.0.1", 0], ["b", "127.0.0.1", server.port]]
    return Ring(ma.kernels, connect_ring(plan, "a", ma, key, a.layout, shm=shm), fold=fold,
                groups=ma.kernels.cfg.n_kv_heads if fold else 1)


def ring_regions() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("tandem-ring-")] if os.path.isdir("/dev/shm") else []


@pytest.mark.parametrize("link, fold", [("tcp", False), ("shm", False), ("shm", True)])
async def test_ring_of_two_workers_over_the_data_plane_is_the_single_worker(two_workers, handoff, single, link, fold):
    """A ring of 2 — the coordinator's own member and one behind an authenticated connection,
    its payloads on the socket (TANDEM_DATA_SHM=0) or through shared memory (the default on one
    host), every segment's state back or the fold by kv head (TANDEM_RING_FOLD) — gives the
    single worker's greedy tokens through the engine's request path; both caches are free again
    when it finishes."""
    import asyncio
    a, b, server = two_workers
    ring = ring_of(a, server, shm=link == "shm", fold=fold)
    assert ring.members[1].link == link and not ring_regions()   # a region is unlinked once mapped
    h = KVBlobHeader.parse(handoff)[0]
    ranges = await asyncio.to_thread(ring.admit, "s#0", h.token_ids, h.num_computed, KVBlobHeader.parse(handoff)[1],
                                     len(h.token_ids) + NEW)
    assert len(ranges) == 2 and b.engine.blocks.num_free < b.engine.blocks.num_blocks   # b holds its shard
    toks = []
    async for out in await a.submit_ring("r", handoff, ring, "s#0"):
        toks += out.token_ids
    assert toks == single[0]
    await asyncio.sleep(0.2)   # b frees its shard when the coordinator's connection closes
    for e in (a, b):
        assert e.engine.blocks.num_free == e.engine.blocks.num_blocks
    assert ring.members[1].bytes_out > 0 and ring.members[1].bytes_back > 0


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no /dev/shm here")
async def test_ring_of_two_in_one_process_over_shm_gives_the_single_worker_s_logits(two_workers, handoff, single):
    """The acceptance's ring of 2 in one process over shm: the scatter (LOAD in 8 MiB messages)
    and every step's q|k|v and states go through the member's shared-memory region; every
    step's logits are bitwise the single worker's fused step, and its KV the same afterwards."""
    import asyncio
    a, b, server = two_workers
    ring = ring_of(a, server)
    remote = ring.members[1]
    assert remote.link == "shm" and not ring_regions()
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    await decodes_as_single(ring, "s", single)
    await holds_single_kv(ring, "s", a.layout, single, len(h.token_ids))
    assert remote.bytes_back > 0
    await asyncio.to_thread(ring.release, "s")
    ring.close()
    await asyncio.sleep(0.2)
    assert b.engine.blocks.num_free == b.engine.blocks.num_blocks


async def test_a_lost_member_ends_the_request_with_a_coded_error(two_workers, handoff):
    import asyncio
    from shared.engine.ring_net import RingMemberLost
    a, b, server = two_workers
    ring = ring_of(a, server)
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s#0", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    stream = await a.submit_ring("r", handoff, ring, "s#0")
    got = 0
    with pytest.raises(RingMemberLost) as err:
        async for out in stream:
            got += len(out.token_ids)
            server.close()   # the member's worker dies mid-stream
    assert got >= 1 and err.value.lost == "b" and err.value.code == "unavailable"
    assert a.engine.blocks.num_free == a.engine.blocks.num_blocks and "r" not in a.engine.seqs
    await asyncio.sleep(0.2)
    assert b.engine.blocks.num_free == b.engine.blocks.num_blocks


@pytest.fixture
def three_workers(bundled_model):
    """The coordinator's engine ``a`` and two members' workers ``b`` and ``c`` on ring ports."""
    yield from _ring_workers(bundled_model)


def _ring_workers(bundled_model, timeout: float = 30.0):
    """Engines ``a`` (the coordinator), ``b`` and ``c`` ({name: AsyncEngine}), ``b`` and ``c``
    hosting members on ring ports ({name: RingServer}, data-plane key on, ``timeout``)."""
    from shared.engine.async_engine import AsyncEngine
    from shared.engine.ring_net import EngineMember, RingServer
    engines = {w: AsyncEngine(Engine(bundled_model, EngineConfig(num_kv_blocks=64, threads=1))) for w in "abc"}
    servers = {}
    for w in "bc":
        servers[w] = RingServer(EngineMember(engines[w].engine, engines[w].run_blocking, w), "127.0.0.1", 0,
                                key=b"data-key", timeout=timeout)
        servers[w].start()
    yield engines, servers
    for srv in servers.values():
        srv.close()
    for e in engines.values():
        e.engine.seqs.clear()


@pytest.mark.parametrize("link", ["tcp", "shm"])
@pytest.mark.parametrize("order, groups, qpass", [
    ("ab", 1, False),    # a ring of 2: the coordinator's member passes its state to b, b back
    ("ab", 3, True),
    ("abc", 3, False),   # b passes its state to c over a link of their own, c to the coordinator
    ("abc", 1, True),    # ... and the q rows go a -> b -> c too
    ("bca", 3, True),    # the coordinator's own member last: c hands it the state
])
async def test_the_fold_across_processes_is_bitwise_the_single_worker(three_workers, handoff, single, link, order,
                                                                     groups, qpass):
    """The fold along the ring between workers (each member folds its segments into the
    running state the one before it passed on, head group by head group, over authenticated
    connections of their own; shm or TCP): every step's logits are bitwise the single worker's
    and the coordinator receives one state per kv head, whatever the context."""
    import asyncio
    from shared.engine.ring_net import EngineMember, connect_ring
    engines, servers = three_workers
    a = engines["a"]
    ma = EngineMember(a.engine, a.run_blocking, "a")
    plan = [[w, "127.0.0.1", servers[w].port if w in servers else 0] for w in order]
    ring = Ring(ma.kernels, connect_ring(plan, "a", ma, b"data-key", a.layout, shm=link == "shm"),
                fold=True, groups=groups, qpass=qpass)
    assert all(m.link == link for m in ring.members if m is not ma)
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    await decodes_as_single(ring, "s", single)
    t = ring.times
    state = ma.kernels.cfg.n_kv_heads * ma.kernels.part_floats(1) * 4
    layers = ma.kernels.cfg.n_layers
    # back to the coordinator: one state per kv head and layer (none when its own member is last)
    assert t.bytes_back == (0 if order.endswith("a") else NEW * layers * state)
    if "bc" in order:     # b -> c on their own link
        assert t.bytes_ring >= NEW * layers * state
    await holds_single_kv(ring, "s", a.layout, single, len(h.token_ids))
    await asyncio.to_thread(ring.release, "s")
    ring.close()
    await asyncio.sleep(0.2)
    for e in engines.values():
        assert e.engine.blocks.num_free == e.engine.blocks.num_blocks
    assert not any(srv._chains or srv._tickets for srv in servers.values())


@pytest.mark.parametrize("order, qpass", [("abc", False), ("bca", True)])
async def test_a_member_lost_inside_the_fold_is_named(three_workers, handoff, order, qpass):
    """b dies between steps (its connections and its link to c close): c finds its link from b
    closed and says so down the ring and to the coordinator — also when b would have passed
    it the q rows (no step starts at c then) —, or the coordinator finds b gone itself; either
    way the next step ends with RingMemberLost naming b, at once."""
    import asyncio
    import time
    from shared.engine.ring_net import EngineMember, RingMemberLost, connect_ring
    engines, servers = three_workers
    a = engines["a"]
    ma = EngineMember(a.engine, a.run_blocking, "a")
    plan = [[w, "127.0.0.1", servers[w].port if w in servers else 0] for w in order]
    ring = Ring(ma.kernels, connect_ring(plan, "a", ma, b"data-key", a.layout), fold=True, groups=3, qpass=qpass)
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    await asyncio.to_thread(ring.generate, "s", 1)
    servers["b"].close()
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    with pytest.raises(RingMemberLost) as err:
        await asyncio.to_thread(ring.generate, "s", 1)
    assert err.value.lost == "b" and err.value.code == "unavailable"
    assert time.monotonic() - t0 < 5      # not the data-plane timeout (30 s)
    await asyncio.to_thread(ring.release, "s")
    await asyncio.sleep(0.2)
    for e in engines.values():
        assert e.engine.blocks.num_free == e.engine.blocks.num_blocks


def test_a_member_refuses_a_connection_without_the_data_plane_key(two_workers):
    from shared.engine.ring_net import RingMemberLost
    a, _, server = two_workers
    with pytest.raises(RingMemberLost, match="refused our proof"):
        ring_of(a, server, key=b"another key")


async def test_a_ring_session_is_promoted_to_one_worker_by_a_migration(two_workers, bundled_model, handoff, single):
    """Mid-stream, the coordinator gathers the ring's shards into a migration blob (the bytes a
    move of a single worker's request carries); a third worker imports it and goes on with the
    single worker's greedy tokens; the ring's KV is freed."""
    import asyncio
    from shared.engine.async_engine import AsyncEngine
    a, b, server = two_workers
    ring = ring_of(a, server)
    h, kv = KVBlobHeader.parse(handoff)
    await asyncio.to_thread(ring.admit, "s#0", h.token_ids, h.num_computed, kv, len(h.token_ids) + NEW)
    stream = await a.submit_ring("r", handoff, ring, "s#0")
    toks = []
    async for out in stream:
        toks += out.token_ids
        if len(toks) >= 3:
            blob = await a.export_for_move("r")
            break
    async for out in stream:   # the steps before the export, then the "migrated" end of the stream
        toks += out.token_ids
        assert out.finish_reason in (None, "migrated")
    assert await a.end_move("r", moved=True) is None
    moved = KVBlobHeader.parse(blob)[0]
    assert moved.num_computed == h.num_computed + len(toks) and moved.token_ids[-len(toks):] == toks
    c = AsyncEngine(Engine(bundled_model, EngineConfig(num_kv_blocks=160, threads=1)))
    try:
        async for out in await c.submit_kv("r", blob):
            toks += out.token_ids
    finally:
        await c.close()
    assert toks == single[0]
    await asyncio.sleep(0.2)
    for e in (a, b):
        assert e.engine.blocks.num_free == e.engine.blocks.num_blocks


# ---- the prefill's scatter: members' ranges parked under a ticket, claimed by the coordinator -----

@pytest.fixture
def parking_workers(bundled_model):
    """As ``three_workers`` ([a, b, c], [b's server, c's]), parked shards freed 1.5 s after the
    scatter unless claimed."""
    for engines, servers in _ring_workers(bundled_model, timeout=1.5):
        yield list(engines.values()), list(servers.values())


def plan_of(servers) -> list:
    return [["a", "127.0.0.1", 0]] + [[n, "127.0.0.1", s.port] for n, s in zip("bc", servers)]


def all_free(*engines) -> bool:
    return all(e.engine.blocks.num_free == e.engine.blocks.num_blocks for e in engines)


async def test_the_prefill_s_scatter_claimed_by_the_coordinator_is_the_single_worker(parking_workers, handoff, single):
    """The prefill loads b's and c's ranges itself, at the same time, parks them under a ticket and
    closes its connections; the coordinator claims them, loads its own range (what the data plane
    brings it) and decodes: every step's logits bitwise the single worker's, the same greedy
    tokens, the same KV afterwards; every cache free once the ring is released."""
    import asyncio
    from shared.engine.ring_net import EngineMember, admit_claimed, connect_ring, new_ticket, ring_ranges, scatter_parked
    (a, b, c), servers = parking_workers
    h, kv = KVBlobHeader.parse(handoff)
    ma = EngineMember(a.engine, a.run_blocking, "a")
    ranges = ring_ranges(h, 3, ma.kernels.max_context)
    assert len(ranges) == 3 and ranges[-1][1] == len(h.token_ids) + NEW
    ticket = new_ticket()
    links = await asyncio.to_thread(scatter_parked, plan_of(servers), "a", ranges, kv, h.num_computed, a.layout,
                                    b"data-key", "pre#0", ticket)
    assert links[0] == "data plane" and set(links[1:]) <= {"shm", "tcp"}
    assert not all_free(b) and not all_free(c)   # parked: their shards outlive the prefill's connections
    from shared.engine.ring import shard_bytes
    own = shard_bytes(a.layout, kv, *ranges[0], h.num_computed)
    assert own.nbytes < kv.nbytes   # the coordinator receives its own range only
    ring = Ring(ma.kernels, connect_ring(plan_of(servers), "a", ma, b"data-key", a.layout))
    await asyncio.to_thread(admit_claimed, ring, "r#0", ticket, h, own, ranges)
    await decodes_as_single(ring, "r#0", single)
    await holds_single_kv(ring, "r#0", a.layout, single, len(h.token_ids))
    await asyncio.to_thread(ring.release, "r#0")
    ring.close()
    await asyncio.sleep(0.2)
    assert all_free(a, b, c)


async def test_a_claim_with_a_wrong_ticket_is_refused_and_an_unclaimed_shard_is_freed(parking_workers, handoff,
                                                                                       caplog):
    import asyncio
    import logging
    from shared.engine.ring_net import RemoteMember, RingMemberError, new_ticket, ring_ranges, scatter_parked
    (a, b, c), servers = parking_workers
    h, kv = KVBlobHeader.parse(handoff)
    ranges = ring_ranges(h, 3, RingKernels.of(a.engine.model).max_context)
    ticket = new_ticket()
    await asyncio.to_thread(scatter_parked, plan_of(servers), "a", ranges, kv, h.num_computed, a.layout,
                            b"data-key", "pre#0", ticket)
    mb = RemoteMember("b", "127.0.0.1", servers[0].port, b"data-key", a.layout, shm=False)
    try:
        with pytest.raises(RingMemberError, match="no shard is parked under that ticket") as err:
            await asyncio.to_thread(mb.claim, "x", new_ticket())
        assert err.value.code == "bad_request"
        assert await asyncio.to_thread(mb.claim, "x", ticket) == ranges[1]   # the right one takes it
    finally:
        mb.close()
    await asyncio.sleep(0.2)
    assert all_free(b) and not all_free(c)   # b's claimed shard went with the claiming connection
    with caplog.at_level(logging.WARNING, logger="tandem.ring"):
        await asyncio.sleep(1.8)   # c's was never claimed: freed after the timeout
    assert all_free(c)
    assert any("was not claimed by its coordinator within 2 s: freed" in r.getMessage() for r in caplog.records)


async def test_a_member_without_room_fails_the_prefill_s_scatter_and_nothing_stays_reserved(bundled_model, parking_workers,
                                                                                          handoff):
    import asyncio
    from shared.engine.async_engine import AsyncEngine
    from shared.engine.ring_net import EngineMember, RingServer, new_ticket, ring_ranges, scatter_parked
    (a, b, _), servers = parking_workers
    small = AsyncEngine(Engine(bundled_model, EngineConfig(num_kv_blocks=16, threads=1)))   # 256 tokens
    tiny = RingServer(EngineMember(small.engine, small.run_blocking, "c"), "127.0.0.1", 0, key=b"data-key")
    tiny.start()
    try:
        h, kv = KVBlobHeader.parse(handoff)
        ranges = ring_ranges(h, 3, RingKernels.of(a.engine.model).max_context)
        plan = [["a", "127.0.0.1", 0], ["b", "127.0.0.1", servers[0].port], ["c", "127.0.0.1", tiny.port]]
        with pytest.raises(RingCapacityError, match=r"c: tokens \[1024, 1529\) need 32 KV blocks"):
            await asyncio.to_thread(scatter_parked, plan, "a", ranges, kv, h.num_computed, a.layout, b"data-key",
                                    "pre#0", new_ticket())
        await asyncio.sleep(0.2)
        assert all_free(b, small) and not servers[0]._parked and not tiny._parked
    finally:
        tiny.close()
        small.engine.seqs.clear()
