"""Ring decode (shared/ring/session.py) on the bundled model, members in this process.

A prompt of 1,520 tokens (6 attention segments of 256) is prefilled once by a single engine
(a prefill worker) and handed off as its KV blob; rings of 2 and 3 members continue it and must
give bitwise the single engine's logits at every step, and its greedy tokens."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kernels import cpu
from kernels.cpu_ring import SEG, RingKernels
from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.kv_cache import KV_DTYPE, KVBlobHeader
from shared.engine.model import AttnChunk, StepContext
from shared.ring.session import LocalMember, Ring, RingCapacityError
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
    members = [LocalMember(kernels, big.layout, member_budget(big.layout, 1024), f"m{i}") for i in range(n_members)]
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
    two = Ring(kernels, [LocalMember(kernels, layout, budget, f"m{i}") for i in range(2)])
    with pytest.raises(RingCapacityError, match=r"m0: tokens \[0, \d+\) need \d+ KV blocks"):
        two.admit_blob("s", handoff, NEW)
    assert all(m.blocks.num_free == m.blocks.num_blocks for m in two.members) and not two.sessions
    three = Ring(kernels, [LocalMember(kernels, layout, budget, f"m{i}") for i in range(3)])
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
            m = LocalMember(kernels, layout, member_budget(layout, 4096), f"m{i}")
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
    members_parts = LocalMember(kernels, layout, member_budget(layout, 2048), "all")
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
    ring = Ring(kernels, [LocalMember(kernels, layout, member_budget(layout, 1024), f"m{i}") for i in range(3)])
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
    m = LocalMember(kernels, big.layout, member_budget(big.layout, 512), "m")
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
