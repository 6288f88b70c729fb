"""The scheduler on its own (shared/engine/scheduler.py), driven as the engine drives it but
without a model: random arrivals of long and short prompts at three tiers, a KV cache that may
run short (preemption, swap), and every step checked — its token budget, each sequence once,
chunks that continue where the sequence is — until every request is done. The engine tests
(tests/integration/test_engine.py) check the same rules case by case with the real model."""

from __future__ import annotations

import random

import pytest
import torch

from shared.engine.kv_cache import BlockManager
from shared.engine.sampling import SamplingParams
from shared.engine.scheduler import SHORT_TOKENS, Scheduler
from shared.engine.sequence import Sequence, Status

BS = 16


def _requests(rng: random.Random, n: int) -> list[tuple[int, Sequence, int]]:
    """(arrival step, sequence, tokens out) of ``n`` requests: a third long prompts, the rest short."""
    out = []
    step = 0
    for i in range(n):
        step += rng.choice([0, 0, 1, 2, 5])
        long = rng.random() < 0.35
        prompt = [rng.randrange(1, 5000) for _ in range(rng.randint(600, 2500) if long else rng.randint(3, 200))]
        seq = Sequence(f"r{i}", prompt, SamplingParams(max_tokens=8), priority=rng.choice([0, 1, 1, 2, 2]))
        out.append((step, seq, rng.randint(1, 8)))
    return out


def _simulate(seed: int, num_blocks: int, max_num_seqs: int) -> dict:
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks, BS, enable_prefix_caching=False)
    kv = torch.zeros(num_blocks, 2)
    sched = Scheduler(blocks, max_num_seqs=max_num_seqs, step_tokens=64, kv=kv, swap_bytes=kv[0].numel() * 4 * 40,
                      shared_step_tokens=8, prefill_step_tokens=512)
    todo = _requests(rng, 40)
    want = {seq.request_id: n for _, seq, n in todo}
    first_run: dict[str, int] = {}
    done: dict[str, int] = {}
    step = 0
    while todo or sched.has_work():
        while todo and todo[0][0] <= step:
            sched.add(todo.pop(0)[1])
        chunks = sched.schedule()
        seqs = [c.seq for c in chunks]
        assert len(set(map(id, seqs))) == len(seqs), f"step {step}: a sequence scheduled twice"
        assert sum(c.num_tokens for c in chunks) <= max(sched.max_tokens, sched.prefill_tokens)
        for c in chunks:
            s = c.seq
            assert s.status is Status.RUNNING and c.start == s.num_computed and c.num_tokens >= 1
            assert c.start + c.num_tokens <= len(s.block_table) * BS        # its blocks are there
            assert c.sample == (c.start + c.num_tokens == s.num_tokens)
            first_run.setdefault(s.request_id, step)
        sched.commit(chunks)
        for c in chunks:
            s = c.seq
            if c.sample:
                s.token_ids.append(rng.randrange(1, 5000))
                if s.num_output_tokens >= want[s.request_id]:
                    sched.drop(s)
                    s.status = Status.FINISHED
                    done[s.request_id] = step
        step += 1
        assert step < 20_000, "the queue never drained"
    assert set(done) == set(want)                                          # nothing lost
    assert blocks.num_free == num_blocks and sched.swap_used == 0          # nothing leaked
    return {"first_run": first_run, "done": done, "steps": step, "preemptions": sched.num_preemptions}


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("num_blocks, max_num_seqs", [(4096, 64), (160, 64), (4096, 2)])
def test_random_arrivals_are_all_served_within_every_step_s_rules(seed, num_blocks, max_num_seqs):
    """Every step keeps its budget and schedules a sequence once, where it left off, in blocks it
    holds; every request finishes and gives back its blocks — with plenty of KV, with KV short
    enough to preempt (160 blocks: 2,560 tokens for prompts of up to 2,500), and with two sequence
    slots. Among the long prompts of one tier (more than ``SHORT_TOKENS`` left, never moved up past
    one another) none starts before one that arrived earlier, unless that one was preempted."""
    got = _simulate(seed, num_blocks, max_num_seqs)
    if got["preemptions"]:
        return
    rng = random.Random(seed)
    longs = [(seq.priority, seq.arrival, seq.request_id) for _, seq, _ in _requests(rng, 40)
             if seq.num_prompt_tokens > 4 * SHORT_TOKENS]
    first = got["first_run"]
    for tier in {t for t, _, _ in longs}:
        order = [rid for t, _, rid in sorted(longs) if t == tier]
        starts = [first[rid] for rid in order]
        assert starts == sorted(starts), (tier, list(zip(order, starts)))


def test_a_short_prompt_passes_long_ones_in_a_few_steps():
    """Three long prompts of a tier queued, then a 74-token one of that tier: half of each 64-token
    step is its, so its prefill is done in three steps, not after the long ones' (about 100 steps)."""
    blocks = BlockManager(4096, BS, enable_prefix_caching=False)
    sched = Scheduler(blocks, max_num_seqs=64, step_tokens=64, kv=torch.zeros(4096, 2), swap_bytes=0,
                      shared_step_tokens=8, prefill_step_tokens=512)
    longs = [Sequence(f"L{i}", [7] * 2000, SamplingParams(max_tokens=1), priority=2) for i in range(3)]
    for s in longs:
        sched.add(s)
    sched.commit(sched.schedule())
    short = Sequence("S", [9] * 74, SamplingParams(max_tokens=1), priority=2)
    sched.add(short)
    for step in range(1, 4):
        chunks = sched.schedule()
        sched.commit(chunks)
        assert any(c.seq is longs[0] for c in chunks)                   # the first long one goes on
        if any(c.seq is short and c.sample for c in chunks):
            break
    else:
        raise AssertionError("the short prompt did not finish its prefill in three steps")
    assert longs[2].num_computed == 0


def _drive(sched: Scheduler, arrivals: dict[int, list[Sequence]], out_tokens: int = 4) -> dict[str, int]:
    """Step ``sched`` until every sequence of ``arrivals`` (step -> sequences added then) has
    ``out_tokens`` tokens out; the step each sequence first ran in."""
    first: dict[str, int] = {}
    step, left = 0, sum(len(v) for v in arrivals.values())
    while left:
        for seq in arrivals.get(step, []):
            sched.add(seq)
        chunks = sched.schedule()
        sched.commit(chunks)
        for c in chunks:
            first.setdefault(c.seq.request_id, step)
            if c.sample:
                c.seq.token_ids.append(5)
                if c.seq.num_output_tokens >= out_tokens:
                    sched.drop(c.seq)
                    c.seq.status = Status.FINISHED
                    left -= 1
        step += 1
        assert step < 10_000
    return first


def _fair_sched(fair: bool = True) -> Scheduler:
    return Scheduler(BlockManager(4096, BS, enable_prefix_caching=False), max_num_seqs=2, step_tokens=64,
                     kv=torch.zeros(4096, 2), swap_bytes=0, shared_step_tokens=8, fair=fair)


def _seq(rid: str, tenant: str, priority: int = 1) -> Sequence:
    return Sequence(rid, [3] * 20, SamplingParams(max_tokens=4), priority=priority, tenant=tenant)


def test_api_keys_share_a_tier_s_queue():
    """Two sequence slots; key A queues 12 requests, then key B one, then A 4 more: B takes the
    next free slot (not the end of A's backlog), A's own run in arrival order — and with ``fair``
    off, B waits for all 12 of A's before it. A cache_salt (``owner:salt``) does not make a
    request another key, and a key idle while another's backlog drained starts where the queue
    is, not with credit saved up."""
    for fair in (True, False):
        a = [_seq(f"A{i}", "keyA" if i % 3 else f"keyA:{i:032x}") for i in range(12)]
        b = _seq("B", "keyB")
        a += [_seq(f"A{i}", "keyA") for i in range(12, 16)]
        first = _drive(_fair_sched(fair), {0: a[:12], 1: [b], 2: a[12:]})
        starts = [first[s.request_id] for s in a]
        assert starts == sorted(starts)                                        # A in arrival order
        ahead = sum(first[s.request_id] < first["B"] for s in a)
        assert ahead == (2 if fair else 12), (fair, ahead, first)              # the two already running
    # B idle while A's backlog grew: B's burst of 6 interleaves with A's queue, one of each in turn
    a = [_seq(f"A{i}", "keyA") for i in range(60)]
    bs = [_seq(f"B{i}", "keyB") for i in range(6)]
    first = _drive(_fair_sched(), {0: a[:2], 1: a[2:], 30: bs})
    late = sorted((first[s.request_id], s.arrival, s.request_id) for s in a + bs if first[s.request_id] > 30)
    assert "".join(rid[0] for _, _, rid in late[:12]) == "AB" * 6, late


def test_one_key_keeps_arrival_order_and_a_better_tier_still_goes_first():
    """With one key (or none) the fair share changes nothing: the random simulation's schedule
    is step for step the same with it on and off. A better tier still passes a worse one of
    any key, and the preemption victim at the cap is the newest of the key furthest ahead."""
    runs = []
    for fair in (True, False):
        rng = random.Random(5)
        blocks = BlockManager(160, BS, enable_prefix_caching=False)
        sched = Scheduler(blocks, max_num_seqs=4, step_tokens=64, kv=torch.zeros(160, 2),
                          swap_bytes=2 * 4 * 40, shared_step_tokens=8, prefill_step_tokens=512, fair=fair)
        todo = _requests(rng, 30)
        runs.append(_drive(sched, {s: [q for t, q, _ in todo if t == s] for s in {t for t, _, _ in todo}}))
        runs[-1] = sorted(runs[-1].items(), key=lambda kv: int(kv[0][1:]))
    assert runs[0] == runs[1]
    sched = _fair_sched()
    a = [_seq(f"A{i}", "keyA", priority=2) for i in range(2)]
    first = _drive(sched, {0: a, 1: [_seq("B", "keyB", priority=2), _seq("I", "keyA", priority=0)]})
    assert first["I"] == 1 and first["B"] > first["I"]          # interactive preempted a batch one
    assert sched.num_preemptions == 1


def test_each_tier_shares_by_its_own_clock_and_imports_leave_no_debt():
    """Each tier's share is its own: key A's 40 queued batch requests do not put A's standard
    request behind key B's standard ones (a probe saw it wait behind 38 of them: one clock for
    every tier). And a key's requests imported running (a prefill's hand-off, a migration) move
    the tier's clock with them: 40 of A's handed off earlier do not queue A's next request
    behind B's 10 (they did: V moved only on admissions from the queue, so imports were debt)."""
    bs = [_seq(f"B{i}", "keyB", priority=1) for i in range(6)]
    batch = [_seq(f"a{i}", "keyA", priority=2) for i in range(40)]
    a = _seq("A", "keyA", priority=1)
    first = _drive(_fair_sched(), {0: batch + bs, 1: [a]})
    assert sum(first[b.request_id] < first["A"] for b in bs) <= 3, first
    assert max(first[b.request_id] for b in bs) <= min(first[s.request_id] for s in batch)   # tiers first

    sched = _fair_sched()
    for i in range(40):                       # handed off to this engine, ran, finished
        s = _seq(f"h{i}", "keyA")
        sched.add_running(s)
        sched.drop(s)
        s.status = Status.FINISHED
    bs = [_seq(f"B{i}", "keyB") for i in range(10)]
    a = _seq("A", "keyA")
    first = _drive(sched, {0: bs, 1: [a]})
    assert sum(first[b.request_id] < first["A"] for b in bs) <= 3, first
