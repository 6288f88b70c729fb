"""A session's KV in one engine through a batch flood (the bundled model, a small KV cache): the
flood's requests reuse their own freed blocks first, so a finished session turn's prompt and reply
stay in the prefix cache; the same flood at the session's tier evicts them, oldest freed first
(LRU). And the next turn — the reply in its prompt — reuses the reply's blocks."""

from __future__ import annotations

import random

from shared.engine.engine import Engine, EngineConfig, run_to_completion
from shared.engine.sampling import SamplingParams
from shared.tier import Tier

BLOCKS = 40          # 640 tokens of KV
PROMPT, REPLY = 100, 30


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def _turn(engine: Engine, rid: str, prompt: list[int], tier: Tier) -> list[int]:
    """Run one session turn; its prompt + reply tokens."""
    done = run_to_completion(engine, {rid: (prompt, SamplingParams(max_tokens=REPLY, temperature=0,
                                                                   ignore_eos=True))}, tier.priority)[rid]
    return prompt + done.token_ids


def _flood(engine: Engine, rng: random.Random, tier: Tier, rounds: int = 4) -> None:
    """Fresh 200-token prompts, two at a time, ``rounds`` times (26 blocks in flight)."""
    for r in range(rounds):
        reqs = {f"flood-{tier}-{r}-{k}": (_ids(rng, 200), SamplingParams(max_tokens=4, temperature=0))
                for k in range(2)}
        run_to_completion(engine, reqs, tier.priority)


def test_a_batch_flood_evicts_its_own_blocks_before_a_sessions(bundled_model):
    rng = random.Random(7)
    engine = Engine(bundled_model, EngineConfig(num_kv_blocks=BLOCKS))
    session = _turn(engine, "turn-1", _ids(rng, PROMPT), Tier.STANDARD)
    held = (len(session) - 1) // 16 * 16   # the reply's last token: never computed
    assert engine.cached_prefix_tokens(session) == held
    _flood(engine, rng, Tier.BATCH)
    assert engine.cached_prefix_tokens(session) == held      # kept through the batch flood
    # the next turn: its prompt holds the last prompt and reply, then new tokens
    nxt = session + _ids(rng, 20)
    done = run_to_completion(engine, {"turn-2": (nxt, SamplingParams(max_tokens=2, temperature=0))},
                             Tier.STANDARD.priority)["turn-2"]
    assert done.num_cached_tokens == held


def test_the_same_flood_at_the_sessions_tier_evicts_it_least_recently_used_first(bundled_model):
    rng = random.Random(7)
    engine = Engine(bundled_model, EngineConfig(num_kv_blocks=BLOCKS))
    session = _turn(engine, "turn-1", _ids(rng, PROMPT), Tier.STANDARD)
    _flood(engine, rng, Tier.STANDARD)
    assert engine.cached_prefix_tokens(session) < (len(session) - 1) // 16 * 16
