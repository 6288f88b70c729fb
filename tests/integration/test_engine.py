"""The engine on the real bundled model: batching, prefix sharing, preemption, KV hand-off."""

from __future__ import annotations

import pytest
import torch

from kvpool.keys import chunk_keys_from_seed, tenant_salt
from shared.engine.engine import Completion, Engine, EngineConfig, run_to_completion
from shared.engine.sampling import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "In 1905, Albert Einstein published",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "Photosynthesis is the process by which",
]


def greedy(n: int = 32, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine(bundled_model) -> Engine:
    return Engine(bundled_model, EngineConfig(num_kv_blocks=256))


def chat_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_chat_answer_is_sensible(engine):
    ids = chat_ids(engine.tokenizer, "What is the capital of France?")
    out = run_to_completion(engine, {"q": (ids, SamplingParams(max_tokens=24, temperature=0))})["q"]
    assert "Paris" in out.text, out.text
    assert out.finish_reason in ("stop", "length")


def test_batched_equals_alone(engine):
    tok = engine.tokenizer
    alone = run_to_completion(engine, {"a": (tok.encode(PROMPTS[0]), greedy())})["a"]
    batch = run_to_completion(engine, {f"b{i}": (tok.encode(p), greedy()) for i, p in enumerate(PROMPTS)})
    assert batch["b0"].token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in batch.values()}) == len(PROMPTS)


def test_prefix_shared_blocks_same_tokens(bundled_model):
    shared = " ".join(["The history of the printing press begins in the fifteenth century."] * 6)
    shared_engine = Engine(bundled_model, EngineConfig(num_kv_blocks=128))
    plain_engine = Engine(bundled_model, EngineConfig(num_kv_blocks=128, enable_prefix_caching=False))
    tok = shared_engine.tokenizer
    reqs = {f"r{i}": (tok.encode(shared + tail), greedy(24)) for i, tail in enumerate([" Then", " Later", " So"])}
    first = run_to_completion(shared_engine, {"r0": reqs["r0"]})
    rest = run_to_completion(shared_engine, {k: v for k, v in reqs.items() if k != "r0"})
    plain = run_to_completion(plain_engine, reqs)
    assert rest["r1"].num_cached_tokens >= 64  # the shared prefix came from the cache
    assert first["r0"].num_cached_tokens == 0
    for k in reqs:
        got = first[k] if k == "r0" else rest[k]
        assert got.token_ids == plain[k].token_ids, k


def test_preemption_under_tiny_kv_budget(bundled_model):
    tok = bundled_model.tokenizer
    reqs = {f"p{i}": (tok.encode(p), greedy(40)) for i, p in enumerate(PROMPTS)}
    roomy = run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=256)), reqs)
    tiny = Engine(bundled_model, EngineConfig(num_kv_blocks=12, enable_prefix_caching=False))
    squeezed = run_to_completion(tiny, reqs)
    assert tiny.scheduler.num_preemptions > 0
    for k in reqs:
        assert squeezed[k].finish_reason == "length"
        assert squeezed[k].token_ids == roomy[k].token_ids, k
    assert tiny.blocks.num_free == 12


def _fit_steps(eng) -> tuple[dict, int]:
    """Step ``eng`` to the end checking ``Scheduler.decodes_fit`` before each step: where it says
    yes, the step's schedule preempts nothing and runs one token of every running sequence, no
    more. Returns how often it said yes and no, and how often yes with a request waiting."""
    said, waited = {True: 0, False: 0}, 0
    schedule = eng.scheduler.schedule
    got = []
    eng.scheduler.schedule = lambda: got.append(schedule()) or got[-1]
    while eng.has_work():
        fit, before, running = eng.scheduler.decodes_fit(), eng.scheduler.num_preemptions, list(eng.scheduler.running)
        waited += fit and bool(eng.scheduler.waiting)
        eng.step()
        said[fit] += 1
        if fit:
            assert eng.scheduler.num_preemptions == before
            assert sorted((c.seq.request_id, c.num_tokens) for c in got[-1]) == \
                sorted((s.request_id, 1) for s in running)
    return said, waited


def test_decodes_fit_says_when_the_next_step_preempts_nothing(bundled_model):
    """``Scheduler.decodes_fit`` (the condition for launching a decode step ahead on the GPU):
    under a tiny KV budget it says no too, and preemptions come; at the sequence cap with a request
    of the same tier waiting (nothing the next step takes up), it says yes."""
    tok = bundled_model.tokenizer
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=12, enable_prefix_caching=False))
    for i, p in enumerate(PROMPTS):
        eng.add(f"p{i}", tok.encode(p), greedy(40))
    said, _ = _fit_steps(eng)
    assert said[True] and said[False] and eng.scheduler.num_preemptions > 0, said
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=256, max_num_seqs=2))
    for i, p in enumerate(PROMPTS[:3]):
        eng.add(f"q{i}", tok.encode(p), greedy(8))
    said, waited = _fit_steps(eng)
    assert waited >= 3 and said[False] >= 2, (said, waited)     # (the two first steps prefill)
    # a better tier arriving at the cap preempts a running batch sequence: not a fit
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=256, max_num_seqs=2))
    for i, p in enumerate(PROMPTS[:2]):
        eng.add(f"b{i}", tok.encode(p), greedy(12), priority=2)
    eng.step()
    eng.step()
    eng.add("inter", tok.encode(PROMPTS[2]), greedy(4), priority=0)
    assert not eng.scheduler.decodes_fit()
    _fit_steps(eng)
    assert eng.scheduler.num_preemptions >= 1


def test_priority_orders_the_queue(bundled_model):
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=256, max_num_seqs=1, step_tokens=64))
    tok = eng.tokenizer
    eng.add("batch", tok.encode(PROMPTS[1]), greedy(4), priority=2)
    eng.add("inter", tok.encode(PROMPTS[2]), greedy(4), priority=0)
    order = []
    while eng.has_work():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["inter", "batch"]


def test_interactive_preempts_running_batch_and_batch_still_finishes(bundled_model):
    """Every slot busy with batch work: an interactive arrival takes a slot at once (the batch
    sequence is swapped out, not lost) and the batch output equals an undisturbed run."""
    tok = bundled_model.tokenizer
    alone = run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=256)),
                              {"batch": (tok.encode(PROMPTS[1]), greedy(24))})["batch"]
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=256, max_num_seqs=1))
    eng.add("batch", tok.encode(PROMPTS[1]), greedy(24), priority=2)
    out = {"batch": [], "inter": []}
    done = []

    def step() -> None:
        for o in eng.step():
            out[o.request_id] += o.token_ids
            if o.finished:
                done.append(o.request_id)

    for _ in range(4):  # batch is decoding
        step()
    assert len(out["batch"]) >= 3 and not done
    eng.add("inter", tok.encode(PROMPTS[2]), greedy(4), priority=0)
    step()
    assert len(out["inter"]) == 1                 # the interactive request got a slot at once
    while eng.has_work():
        step()
    assert done == ["inter", "batch"]
    assert eng.scheduler.num_preemptions >= 1
    assert out["batch"] == alone.token_ids        # every step's tokens, the first four included
    assert len(out["inter"]) == 4
    assert eng.blocks.num_free == 256


def test_a_prompt_that_evicts_a_decode_scheduled_in_the_same_step(bundled_model):
    """The KV is full with a batch request decoding; an interactive prompt arrives that needs its
    blocks. Decodes are scheduled first, so the batch sequence already has its chunk in the step
    when the interactive admission preempts it: that chunk must leave the step with it (it once
    stayed, with no blocks left, and the step failed with an IndexError — every request on the
    engine lost: issue 33's "list index out of range" under chaos). Both answers are the
    undisturbed ones."""
    tok = bundled_model.tokenizer
    batch_ids = tok.encode(" ".join(f"b{i}" for i in range(20)))       # ~55 tokens: 4 blocks, growing to 5
    inter_ids = tok.encode(" ".join(f"i{i}" for i in range(45)))       # ~125 tokens: 8 blocks
    roomy = Engine(bundled_model, EngineConfig(num_kv_blocks=256, enable_prefix_caching=False))
    want = run_to_completion(roomy, {"batch": (batch_ids, greedy(24)), "inter": (inter_ids, greedy(8))})
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=10, enable_prefix_caching=False))
    assert len(inter_ids) > 16 * (10 - -(-(len(batch_ids) + 3) // 16))  # it cannot fit beside the batch one
    eng.add("batch", batch_ids, greedy(24), priority=2)
    got = {"batch": [], "inter": []}
    while len(got["batch"]) < 3:
        for o in eng.step():
            got[o.request_id] += o.token_ids
    eng.add("inter", inter_ids, greedy(8), priority=0)
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.token_ids
    assert eng.scheduler.num_preemptions >= 1
    assert got["batch"] == want["batch"].token_ids and got["inter"] == want["inter"].token_ids
    assert eng.blocks.num_free == 10


def test_interactive_prompt_is_not_held_behind_a_batch_prefill(bundled_model):
    """A long batch prompt is in chunked prefill; an interactive prompt that arrives gets the
    step's token budget first and its first token comes out while the batch prefill goes on;
    while the interactive request decodes, the batch prefill takes at most
    ``shared_step_tokens`` of each step; once it is done, the whole budget again."""
    tok = bundled_model.tokenizer
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=256, step_tokens=128,
                                             shared_step_tokens=16))
    eng.add("batch", tok.encode(" ".join(PROMPTS) * 8)[:600], greedy(4), priority=2)
    eng.step()
    eng.add("inter", tok.encode(PROMPTS[3]), greedy(4), priority=0)
    first = eng.step()
    assert [o.request_id for o in first if o.token_ids] == ["inter"]
    batch = eng.seqs["batch"]
    grew = []
    while "inter" in eng.seqs:
        before = batch.num_computed
        eng.step()
        grew.append(batch.num_computed - before)
    assert grew and max(grew) <= 16
    before = batch.num_computed
    eng.step()
    assert batch.num_computed - before == 128      # interactive gone: the full budget
    while eng.has_work():
        eng.step()
    assert eng.blocks.num_free == 256


def test_a_short_prompt_is_not_held_behind_a_long_one_of_its_tier(bundled_model):
    """A long prompt is in chunked prefill; a short one of the same tier arrives: the long one
    leaves it half the step, so its first token comes out in the next step, not after the long
    prefill; the long one goes on at half the step meanwhile and has the whole step again once
    the short one is in; two long prompts keep their order (the first one takes every step)."""
    tok = bundled_model.tokenizer
    long_prompt = tok.encode(" ".join(PROMPTS) * 8)[:600]
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=256, step_tokens=128, prefill_step_tokens=128,
                                             enable_prefix_caching=False))
    eng.add("long", long_prompt, greedy(2))
    eng.step()
    eng.add("short", tok.encode(PROMPTS[3]), greedy(2))
    long_seq, before = eng.seqs["long"], eng.seqs["long"].num_computed
    first = eng.step()
    assert [o.request_id for o in first if o.token_ids] == ["short"]
    assert long_seq.num_computed - before == 64                    # half the step
    before = long_seq.num_computed
    eng.step()
    assert long_seq.num_computed - before == 128 - 1               # the short one decodes: the rest
    while eng.has_work():
        eng.step()
    eng.add("long1", long_prompt[::-1], greedy(2))
    eng.step()
    eng.add("long2", long_prompt[1:], greedy(2))
    eng.step()
    assert eng.seqs["long2"].num_computed == 0 and eng.seqs["long1"].num_computed == 256   # FIFO
    while eng.has_work():
        eng.step()
    assert eng.blocks.num_free == 256


def test_a_short_prompt_passes_several_long_ones_of_its_tier(bundled_model):
    """Three long prompts queued, then two short ones of the same tier: the first long one
    leaves half the step to both short ones (past the two long ones waiting), which each
    sample their first token in the next step; the long ones keep their order among
    themselves (the second takes only what is left of a step), and a short prompt of a worse
    tier is not moved up."""
    tok = bundled_model.tokenizer
    text = tok.encode(" ".join(PROMPTS) * 8)
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=512, step_tokens=128, prefill_step_tokens=128,
                                             enable_prefix_caching=False))
    for i in range(3):
        eng.add(f"long{i}", text[i:600 + i], greedy(2))
    eng.step()
    eng.add("batch", tok.encode(PROMPTS[2]), greedy(2), priority=2)
    eng.add("short0", tok.encode(PROMPTS[3]), greedy(2))
    eng.add("short1", tok.encode(PROMPTS[1]), greedy(2))
    before = eng.seqs["long0"].num_computed
    first = eng.step()
    assert sorted(o.request_id for o in first if o.token_ids) == ["short0", "short1"]
    assert eng.seqs["long0"].num_computed - before == 64                     # half the step
    assert eng.seqs["long2"].num_computed == 0              # (long1 may take what the short ones left)
    assert eng.seqs["batch"].num_computed == 0                              # a worse tier waits
    while eng.seqs["long0"].num_computed < eng.seqs["long0"].num_tokens - 1:
        eng.step()
        assert eng.seqs["long2"].num_computed == 0                          # FIFO among the long
    while eng.has_work():
        eng.step()
    assert eng.blocks.num_free == 512

    # a short prompt longer than half the step (a 40-token chat behind 600 tokens in 32-token
    # steps, a batch flood's step on a CPU worker): half the step each step until it is in
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=512, step_tokens=32, prefill_step_tokens=32, max_num_seqs=8,
                                             enable_prefix_caching=False))
    for i in range(2):
        eng.add(f"long{i}", text[i:600 + i], greedy(2), priority=2)
    eng.step()
    chat = tok.encode(" ".join(PROMPTS[:6]))
    assert 16 < len(chat) <= 150
    eng.add("chat", chat, greedy(2), priority=2)
    steps = 0
    while not eng.seqs["chat"].output_token_ids:
        before = eng.seqs["long0"].num_computed
        eng.step()
        steps += 1
        assert eng.seqs["long0"].num_computed - before == 16                # the long one keeps half
    assert steps == -(-len(chat) // 16)                                     # the chat: the other half
    assert eng.seqs["long1"].num_computed < 16                              # what the chat left of a step


def test_batch_kv_is_evicted_before_interactive_kv(bundled_model):
    """Finished requests leave their KV in the prefix cache; under pressure the batch
    request's blocks are reused first, so the interactive prefix is still cached."""
    tok = bundled_model.tokenizer
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=24))
    inter, batch = tok.encode(PROMPTS[1] * 3), tok.encode(PROMPTS[2] * 3)
    run_to_completion(eng, {"i": (inter, greedy(2))})
    eng.add("b", batch, greedy(2), priority=2)
    while eng.has_work():
        eng.step()
    n_i, n_b = eng.cached_prefix_tokens(inter), eng.cached_prefix_tokens(batch)
    assert n_i > 0 and n_b > 0
    got = eng.blocks.allocate(3)   # plenty of never-used blocks are free: FIFO reuse would take those
    assert got is not None
    assert eng.cached_prefix_tokens(inter) == n_i       # interactive KV kept hot
    assert eng.cached_prefix_tokens(batch) < n_b        # batch KV went first
    eng.blocks.release(got)


def run_as(engine: Engine, rid: str, ids: list[int], tenant: str) -> Completion:
    engine.add(rid, ids, greedy(8), tenant=tenant)
    done = Completion(rid)
    while done.finish_reason is None:
        for out in engine.step():
            done.add(out)
    return done


def test_tenants_share_no_cached_kv(bundled_model):
    """A tenant's blocks (computed, loaded from the pool, imported) serve only that tenant; its
    chunk events carry the keys the router computes for that tenant."""
    engine = Engine(bundled_model, EngineConfig(num_kv_blocks=128))
    seed, events = bytes(range(32)), []
    engine.watch_chunks(seed, 32, lambda stored, evicted: events.extend(stored))
    ids = engine.tokenizer.encode(" ".join(["The history of the printing press begins in the fifteenth century."] * 10))
    a1 = run_as(engine, "a1", ids, "alice")
    a2 = run_as(engine, "a2", ids, "alice")
    assert a1.num_cached_tokens == 0 and a2.num_cached_tokens >= 64
    assert engine.cached_prefix_tokens(ids, "alice") >= 64
    assert engine.cached_prefix_tokens(ids, "bob") == engine.cached_prefix_tokens(ids) == 0
    assert set(chunk_keys_from_seed(seed.hex(), 32, ids[:a2.num_cached_tokens], tenant="alice")) <= set(events)
    assert not set(chunk_keys_from_seed(seed.hex(), 32, ids)) & set(events)   # the public tenant's keys
    b = run_as(engine, "b", ids, "bob")
    public = run_as(engine, "p", ids, "")
    assert b.num_cached_tokens == public.num_cached_tokens == 0
    assert b.token_ids == public.token_ids == a1.token_ids

    n = len(ids) // 16 * 16   # alice's KV, as the pool would hand it over, loaded into a fresh engine
    kv = engine.read_blocks(engine.blocks.match_prefix(ids, n, tenant_salt("alice")))
    fresh = Engine(bundled_model, EngineConfig(num_kv_blocks=128))
    assert fresh.load_prefix(ids[:n], kv, tenant="alice") == n
    assert fresh.cached_prefix_tokens(ids, "alice") == n and fresh.cached_prefix_tokens(ids, "bob") == 0

    fresh.add("x", ids, greedy(8), prefill_only=True, tenant="carol")   # a hand-off keeps the tenant
    while "x" in fresh.seqs and fresh.seqs["x"].status.value != "parked":
        fresh.step()
    blob = fresh.export_kv("x")
    decode = Engine(bundled_model, EngineConfig(num_kv_blocks=128))
    decode.import_kv("x", blob)
    assert decode.cached_prefix_tokens(ids, "carol") >= 64 and decode.cached_prefix_tokens(ids, "alice") == 0


def test_export_import_continue_equals_uninterrupted(bundled_model):
    tok = bundled_model.tokenizer
    ids = chat_ids(tok, "Write a short poem about the sea.")
    full = run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=64)), {"x": (ids, greedy(64))})["x"]

    prefill = Engine(bundled_model, EngineConfig(num_kv_blocks=64))
    decode = Engine(bundled_model, EngineConfig(num_kv_blocks=64))
    prefill.add("x", ids, greedy(64), prefill_only=True)
    first = [o for o in prefill.step() if o.request_id == "x"]
    assert first[-1].finish_reason == "prefilled"
    blob = prefill.export_kv("x")
    assert prefill.blocks.num_free == 64 and "x" not in prefill.seqs
    decode.import_kv("x", blob)
    tokens, text = list(first[-1].token_ids), first[-1].text
    while decode.has_work():
        for o in decode.step():
            tokens += o.token_ids
            text += o.text
    assert tokens == full.token_ids
    assert text == full.text


def test_a_hand_off_past_the_sequence_cap_waits_its_turn(bundled_model):
    """Every sequence slot taken, a hand-off from prefill (which has nowhere else to run) waits in
    its tier's queue with its KV in host memory, as a preempted sequence's, and is swapped in at
    the next free slot — it ran past the cap (two router copies each placing a burst: 7 sequences
    on a worker of 4). A live move (``at_cap="refuse"``) is refused instead. The tokens are the
    uninterrupted runs'."""
    from shared.engine.handoff import EngineFull
    tok = bundled_model.tokenizer
    prompts = {"x": chat_ids(tok, "Write a short poem about the sea."), "y": tok.encode(PROMPTS[4])}
    full = {r: run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=64)), {r: (ids, greedy(24))})[r]
            for r, ids in prompts.items()}
    decode = Engine(bundled_model, EngineConfig(num_kv_blocks=64, max_num_seqs=1, step_tokens=64))
    got = {}
    for r, ids in prompts.items():
        prefill = Engine(bundled_model, EngineConfig(num_kv_blocks=64))
        prefill.add(r, ids, greedy(24), prefill_only=True)
        first = [o for o in prefill.step() if o.request_id == r]
        got[r] = list(first[-1].token_ids)
        blob = prefill.export_kv(r)
        if r == "y":
            with pytest.raises(EngineFull):
                decode.import_kv(r, blob, at_cap="refuse")
        decode.import_kv(r, blob)
    queued = decode.seqs["y"]
    assert queued in decode.scheduler.waiting and queued.swapped is not None and queued.block_table == []
    while decode.has_work():
        assert len(decode.scheduler.running) <= 1
        for o in decode.step():
            got[o.request_id] += o.token_ids
    assert got == {r: f.token_ids for r, f in full.items()}
    assert decode.scheduler.swap_used == 0


def test_migration_mid_decode(bundled_model):
    """Export between two decode steps (not only after prefill) and continue elsewhere."""
    tok = bundled_model.tokenizer
    ids = tok.encode(PROMPTS[4])
    full = run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=64)), {"m": (ids, greedy(40))})["m"]
    a = Engine(bundled_model, EngineConfig(num_kv_blocks=64))
    a.add("m", ids, greedy(40))
    got = []
    for _ in range(10):
        got += [t for o in a.step() for t in o.token_ids]
    b = Engine(bundled_model, EngineConfig(num_kv_blocks=64))
    b.import_kv("m", a.export_kv("m"))
    while b.has_work():
        got += [t for o in b.step() for t in o.token_ids]
    assert got == full.token_ids


def test_stop_strings_across_a_migration(bundled_model):
    """A moved sequence's stop matcher is rebuilt from the text it held back: the output is the
    unmoved one's, held-back text and cut included."""
    tok = bundled_model.tokenizer
    ids = tok.encode(PROMPTS[4])
    free = run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=64)), {"f": (ids, greedy(40))})["f"]
    stops = [free.text[30:42] + "\x01", free.text[60:70]]   # a prefix that never completes, then a real one
    want = run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=64)),
                             {"m": (ids, greedy(40, stop=stops))})["m"]
    assert want.finish_reason == "stop" and len(want.text) < len(free.text)
    a = Engine(bundled_model, EngineConfig(num_kv_blocks=64))
    a.add("m", ids, greedy(40, stop=stops))
    text = ""
    while a.seqs["m"].stops is None or a.seqs["m"].stops.holdback == 0:  # move it while it holds text back
        text += "".join(o.text for o in a.step())
    b = Engine(bundled_model, EngineConfig(num_kv_blocks=64))
    b.import_kv("m", a.export_kv("m"))
    while b.has_work():
        text += "".join(o.text for o in b.step())
    assert text == want.text


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    tok = engine.tokenizer
    p = dict(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = run_to_completion(engine, {"s": (tok.encode(PROMPTS[5]), SamplingParams(**p))})["s"]
    b = run_to_completion(engine, {"s": (tok.encode(PROMPTS[5]), SamplingParams(**p)),
                                   "o": (tok.encode(PROMPTS[6]), SamplingParams(**p))})["s"]
    c = run_to_completion(engine, {"s": (tok.encode(PROMPTS[5]), SamplingParams(**dict(p, seed=99)))})["s"]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_strings_and_lengths(engine):
    tok = engine.tokenizer
    ids = tok.encode("1, 2, 3, 4, 5, 6, 7, 8,")
    free = run_to_completion(engine, {"f": (ids, greedy(30))})["f"]
    assert free.finish_reason == "length" and free.num_output_tokens == 30
    stop_at = free.text.split(",")[2] + ","   # e.g. " 11,"
    cut = run_to_completion(engine, {"c": (ids, greedy(30, stop=[stop_at]))})["c"]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop_at)]
    assert stop_at not in cut.text
    # logprobs go out with their text: none for the stop string's tokens, none ahead of the text
    # (a text held back as a possible stop string held its tokens' logprobs back too)
    engine.add("lp", ids, greedy(30, stop=[stop_at], logprobs=True))
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in engine.step() if o.request_id == "lp"]
    text, spelled = "", b""
    for o in outs:
        text += o.text
        spelled += b"".join(tok.token_bytes(lp.token_id) for lp in o.logprobs or [])
        assert len(spelled.decode(errors="ignore")) <= len(text), (text, spelled)
    assert text == cut.text and spelled.decode() == cut.text
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    eos = run_to_completion(engine, {"e": (ids, greedy(30, stop_token_ids=[stop_tok]))})["e"]
    assert eos.finish_reason == "stop" and eos.token_ids == free.token_ids[:first]
    assert eos.num_output_tokens == first + 1  # the stop token counts as generated, is not shown


def test_logprobs(engine):
    tok = engine.tokenizer
    out = run_to_completion(engine, {"l": (tok.encode(PROMPTS[3]), greedy(5, logprobs=True, top_logprobs=3))})["l"]
    assert len(out.logprobs) == 5
    for lp, t in zip(out.logprobs, out.token_ids):
        assert lp.token_id == t and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == t  # greedy picks the most likely token
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_penalties_change_output(engine):
    tok = engine.tokenizer
    ids = tok.encode("the the the the the")
    plain = run_to_completion(engine, {"p": (ids, greedy(12))})["p"]
    pen = run_to_completion(engine, {"p": (ids, greedy(12, repetition_penalty=1.5, frequency_penalty=1.0))})["p"]
    assert plain.token_ids != pen.token_ids


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=2.01), dict(top_p=0), dict(top_k=-3), dict(max_tokens=0),
                                 dict(min_p=2), dict(top_logprobs=50), dict(stop=[""])])
def test_invalid_sampling_rejected(engine, bad):
    field = next(iter(bad))
    with pytest.raises(ValueError, match=field):
        engine.add("bad", [1, 2, 3], SamplingParams(**bad))
    assert "bad" not in engine.seqs


def test_prompt_longer_than_context_rejected(bundled_model):
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=64, max_context=128))
    with pytest.raises(ValueError, match="context"):
        eng.add("long", [1] * 200, greedy(4))
    assert not eng.has_work()


def test_a_sequence_that_fills_the_whole_kv_cache_ends_with_length(bundled_model):
    # 4 blocks of 16 tokens: the context is capped at 64 (a sequence alone may not outgrow the
    # cache: before, it preempted itself and recomputed forever)
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=4, enable_prefix_caching=False, swap_bytes=0))
    assert eng.max_context == 64
    done = run_to_completion(eng, {"x": (list(range(10, 30)), greedy(500))})["x"]
    assert done.finish_reason == "length" and len(done.token_ids) == 64 - 20
    with pytest.raises(ValueError, match="context"):
        eng.add("long", [1] * 64, greedy(4))


def test_abort_frees_blocks(engine):
    tok = engine.tokenizer
    free = engine.blocks.num_free
    engine.add("ab", tok.encode(PROMPTS[0]), greedy(100))
    engine.step()
    assert engine.blocks.num_free < free
    assert engine.abort("ab")
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == "ab"] == ["abort"]
    assert engine.blocks.num_free == free


def test_thread_count_does_not_change_tokens(bundled_model):
    """Workers run with different thread counts; a session must decode the same anywhere."""
    tok = bundled_model.tokenizer
    ids = chat_ids(tok, "What is the capital of France?")
    outs = []
    for t in (1, 2):
        eng = Engine(bundled_model, EngineConfig(num_kv_blocks=64, threads=t))
        outs.append(run_to_completion(eng, {"t": (ids, greedy(48))})["t"].token_ids)
    assert outs[0] == outs[1]


def test_prompts_alone_take_throughput_sized_steps(bundled_model):
    """While nothing decodes, a prompt computes ``prefill_step_tokens`` a step; once a sequence
    decodes (its stream waits on every step), ``step_tokens`` again; the output is the same. A
    batch prompt keeps short steps (an interactive arrival waits for one step at most)."""
    tok = bundled_model.tokenizer
    prompt = tok.encode(" ".join(PROMPTS) * 8)[:600]
    small = run_to_completion(Engine(bundled_model, EngineConfig(num_kv_blocks=256, step_tokens=64)),
                              {"long": (prompt, greedy(4))})["long"]
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=256, step_tokens=64, prefill_step_tokens=256))
    got = {"long": [], "short": []}

    def step() -> None:
        for o in eng.step():
            got[o.request_id] += o.token_ids

    eng.add("long", prompt, greedy(4))
    step()
    assert eng.seqs["long"].num_computed == 256                 # alone: the prefill budget
    eng.add("short", tok.encode(PROMPTS[0]), greedy(8))
    while eng.seqs["short"].num_computed < eng.seqs["short"].num_tokens - 1:
        step()                                                   # "short" decodes from here on
    before = eng.seqs["long"].num_computed
    step()
    assert eng.seqs["long"].num_computed - before <= 64         # a stream waits on this step
    while eng.has_work():
        step()
    assert got["long"] == small.token_ids                       # step sizes never change the output
    eng.add("batch", prompt[::-1][:300], greedy(2), priority=2)  # nothing of it cached
    eng.step()
    assert eng.seqs["batch"].num_computed == 64


def test_warm_up_leaves_the_engine_as_it_was(bundled_model):
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=64))
    free = eng.blocks.num_free
    assert eng.warm_up() > 0 and eng.blocks.num_free == free and not eng.has_work()
    assert run_to_completion(eng, {"r": (eng.tokenizer.encode(PROMPTS[0]), greedy(4))})["r"].num_output_tokens == 4


def test_warm_up_on_cuda_runs_the_prefill_variants(bundled_model, monkeypatch):
    """On CUDA the warm-up also prefills one prompt of each length class Triton specializes on (M a
    multiple of 16 or not; 16, 32 and 64-row tiles), so their compiles happen before any request."""
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=64))
    seen = []
    monkeypatch.setattr(eng, "prompt_logits", lambda ids: seen.append(len(ids)))
    eng.warm_up()
    assert seen == [16]                                            # the CPU: one short pass
    seen.clear()
    monkeypatch.setattr(eng, "device", torch.device("cuda"))      # (graphs stay None: nothing captures)
    eng.warm_up()
    assert seen[0] == 16 and {n % 16 == 0 for n in seen} == {True, False}
    assert {16 if n <= 16 else 32 if n <= 32 else 64 for n in seen} == {16, 32, 64}


def test_the_host_share_bench_runs_the_graphs_path_with_a_stub(bundled_model):
    """bench/gpu_host.py: the engine's real decode-graphs path (try_step, the static buffers) with
    a graph that does no work — every decode step goes through it and yields the stub's tokens."""
    from bench.gpu_host import TEXT, StubGraphs
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=64, max_num_seqs=4))
    text = eng.tokenizer.encode(TEXT, add_special_tokens=False)
    eng.graphs = StubGraphs(4, 512, eng.layout.block_size, bundled_model.config.vocab_size, text)
    got = run_to_completion(eng, {f"r{i}": (eng.tokenizer.encode(PROMPTS[i]), greedy(6)) for i in range(3)})
    order = sorted(got)        # rows in the order the engine added them
    for row, rid in enumerate(order):   # step k (1..5) gives row r text[k + r]; the first token is the prefill's
        assert got[rid].token_ids[1:] == [text[(k + row) % len(text)] for k in range(1, 6)]
    assert eng.graphs.steps == 5       # the last step was fed each row's token of the step before
    assert eng.graphs.inputs.host_view("ids")[:3].tolist() == [text[(4 + row) % len(text)] for row in range(3)]


def test_a_resumed_request_reports_the_prompt_tokens_it_found_cached(bundled_model):
    """A request resumed on a worker whose prefix cache holds its prompt said cached_tokens 0 in
    its usage (it counted reuse only for requests with no output yet), while a warm run of the
    same prompt says nearly all of it."""
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=128))
    prompt = eng.tokenizer.encode(" ".join(["The printing press spread across Europe."] * 12))
    first = run_to_completion(eng, {"a": (prompt, greedy(12))})["a"]
    warm = run_to_completion(eng, {"b": (prompt, greedy(12))})["b"]
    assert warm.num_cached_tokens >= len(prompt) - eng.layout.block_size
    done = Completion("r")
    eng.add("r", prompt, greedy(12), resume_token_ids=first.token_ids[:5],
            emitted_chars=len(eng.tokenizer.decode(first.token_ids[:5])))
    while done.finish_reason is None:
        for out in eng.step():
            if out.request_id == "r":
                done.add(out)
    assert done.token_ids == first.token_ids[5:]
    assert done.num_cached_tokens == warm.num_cached_tokens, (done.num_cached_tokens, warm.num_cached_tokens)


def test_a_full_engine_queue_still_takes_a_light_key_s_request(bundled_model):
    """TANDEM_MAX_WAITING (here 4) reached by key A's requests: A's next is refused (EngineFull:
    the caller answers "overloaded"), key B's — under its share of the queue — is taken, up to
    twice the limit; stats say who waits."""
    from shared.engine.engine import EngineFull
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=64, max_waiting=4))
    ids = eng.tokenizer.encode(PROMPTS[0])
    for i in range(4):
        eng.add(f"a{i}", ids, greedy(4), tenant="keyA")
    with pytest.raises(EngineFull):
        eng.add("a4", ids, greedy(4), tenant="keyA:salted")     # a cache_salt is the same key
    eng.add("b0", ids, greedy(4), tenant="keyB")
    assert eng.stats()["waiting_by_owner"] == {"keyA": {1: 4}, "keyB": {1: 1}}
    eng.add("b1", ids, greedy(4), tenant="keyB")
    with pytest.raises(EngineFull):                              # B holds its share now: 2 of 4 / 2
        eng.add("b2", ids, greedy(4), tenant="keyB")


def test_a_request_re_tiered_in_place_runs_at_its_new_priority(bundled_model):
    """``set_priority`` (a session's tier changed, its pool did not): a waiting request takes its
    place in the new tier's queue; a running one keeps running, at the new priority."""
    eng = Engine(bundled_model, EngineConfig(num_kv_blocks=64, max_num_seqs=1))
    ids = eng.tokenizer.encode(PROMPTS[0])
    for rid in ("a", "b", "c"):
        eng.add(rid, ids, greedy(4), priority=1)
    eng.step()                                           # a runs; b, c wait
    assert [s.request_id for s in eng.scheduler.waiting] == ["b", "c"]
    eng.set_priority("c", 0)
    assert [s.request_id for s in eng.scheduler.waiting] == ["c", "b"] and eng.seqs["c"].priority == 0
    eng.set_priority("a", 2)
    assert eng.seqs["a"].priority == 2 and eng.seqs["a"].fair_tag
    eng.step()                                           # c (interactive) preempts a (batch now)
    assert [s.request_id for s in eng.scheduler.running] == ["c"]
    with pytest.raises(KeyError):
        eng.set_priority("nope", 0)
