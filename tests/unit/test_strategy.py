"""Execution strategies (shared/strategy.py) as pure functions over tables, and the per-role KV budgets."""

from __future__ import annotations

import re

import pytest

from shared import subjects
from shared.settings import Settings
from shared.strategy import SEG, NoCapacity, PoolWorker, Strategy, choose, shard_ranges


def test_seg_is_the_kernels_segment():
    src = (__import__("pathlib").Path(__file__).parents[2] / "kernels" / "forward_cpu.cpp").read_text()
    assert re.search(r"constexpr int64_t SEG = (\d+);", src).group(1) == str(SEG)


@pytest.mark.parametrize("total, n, want", [
    (256, 1, [(0, 256)]),
    (1000, 1, [(0, 1000)]),
    (1529, 3, [(0, 512), (512, 1024), (1024, 1529)]),
    (1809, 3, [(0, 768), (768, 1536), (1536, 1809)]),     # 8 segments: 3, 3, 2
    (513, 3, [(0, 256), (256, 512), (512, 513)]),
    (8192, 4, [(0, 2048), (2048, 4096), (4096, 6144), (6144, 8192)]),
])
def test_shard_ranges(total, n, want):
    got = shard_ranges(total, n)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == total and all(a % SEG == 0 for a, _ in got)
    assert all(b == c for (_, b), (c, _) in zip(got, got[1:]))


@pytest.mark.parametrize("total, n", [(512, 3), (0, 1), (100, 0)])
def test_shard_ranges_refuses(total, n):
    with pytest.raises(ValueError):
        shard_ranges(total, n)


def gpu(i, free, ctx=8192):
    return PoolWorker(f"g{i}", subjects.GPU_DECODE, free, ctx)


def cpu(i, free, ctx=8192):
    return PoolWorker(f"c{i}", subjects.CPU_DECODE, free, ctx)


CASES = [
    # tier, context, workers, expected strategy, expected workers
    ("interactive", 2000, [gpu(0, 4000), cpu(0, 9000)], "gpu", ("g0",)),
    ("batch", 2000, [gpu(0, 4000), cpu(0, 9000)], "cpu", ("c0",)),
    ("standard", 2000, [gpu(0, 4000), cpu(0, 1000), cpu(1, 3000)], "cpu", ("c1",)),
    # no single cpu worker holds 3,000 tokens: the fewest members that do (12 segments: 4 each)
    ("batch", 3000, [cpu(0, 1300), cpu(1, 1300), cpu(2, 1300)], "cpu-ring(3)", ("c0", "c1", "c2")),
    ("batch", 3000, [cpu(0, 1600), cpu(1, 1600), cpu(2, 1300)], "cpu-ring(2)", ("c0", "c1")),
    # the largest shard goes to the freest worker (9 segments: 5 + 4)
    ("batch", 2300, [cpu(0, 1100), cpu(1, 1400), cpu(2, 100)], "cpu-ring(2)", ("c1", "c0")),   # 1280 + 1020
    # interactive prefers a gpu, then one cpu worker, then a ring
    ("interactive", 3000, [gpu(0, 1000), cpu(0, 3500)], "cpu", ("c0",)),
    ("interactive", 3000, [gpu(0, 1000), cpu(0, 1600), cpu(1, 1600)], "cpu-ring(2)", ("c0", "c1")),
    # batch falls back to a gpu when no cpu worker (nor ring) holds it
    ("batch", 3000, [gpu(0, 4000), cpu(0, 1000), cpu(1, 1000)], "gpu", ("g0",)),
    # a worker whose engine context is too short does not count as single, whatever its free KV
    ("batch", 3000, [cpu(0, 9000, ctx=2048), cpu(1, 9000, ctx=2048)], "cpu-ring(2)", ("c0", "c1")),
]


@pytest.mark.parametrize("tier, ctx, workers, kind, members", CASES)
def test_choose_table(tier, ctx, workers, kind, members):
    s, why = choose(tier, ctx, workers)
    assert (str(s), s.workers) == (kind, members)
    assert why.startswith(f"{tier} -> {kind}")


def test_choose_refuses_with_a_reason():
    with pytest.raises(NoCapacity, match="3000 tokens"):
        choose("batch", 3000, [cpu(0, 1000), cpu(1, 1000)])
    with pytest.raises(NoCapacity, match="no workers"):
        choose("interactive", 10, [])
    with pytest.raises(NoCapacity):   # a ring needs 5 members; at most 4 allowed
        choose("batch", 5 * SEG, [cpu(i, SEG) for i in range(6)], max_members=4)
    assert str(choose("batch", 5 * SEG, [cpu(i, SEG) for i in range(6)])[0]) == "cpu-ring(5)"


def test_strategy_names():
    assert Strategy.parse_kind("cpu-ring(3)") == ("cpu-ring", 3)
    assert Strategy.parse_kind("gpu") == ("gpu", 1)
    for bad in ("cpu-ring(0)", "cpu-ring(99)", "ring", "cpu-ring(x)"):
        with pytest.raises(ValueError, match="cpu-ring"):
            Strategy.parse_kind(bad)


def test_role_kv_budgets_override_the_global_one():
    w = Settings.from_env({"TANDEM_KV_BUDGET_MB": "256", "TANDEM_KV_BUDGET_MB_CPU_DECODE": "30"}).worker
    assert w.kv_budget_mb_for(subjects.CPU_DECODE) == 30
    assert w.kv_budget_mb_for(subjects.GPU_DECODE) == 256
    assert w.kv_budget_mb_for(subjects.PREFILL) == 256
    assert w.kv_budget_mb_for("") == 256
    w = Settings.from_env({"TANDEM_KV_BUDGET_MB_PREFILL": "1024", "TANDEM_KV_BUDGET_MB_GPU_DECODE": "64"}).worker
    assert (w.kv_budget_mb_for(subjects.PREFILL), w.kv_budget_mb_for(subjects.GPU_DECODE)) == (1024, 64)
    with pytest.raises(ValueError, match="TANDEM_KV_BUDGET_MB_CPU_DECODE"):
        Settings.from_env({"TANDEM_KV_BUDGET_MB_CPU_DECODE": "-1"})


def test_worker_engine_config_uses_the_role_budget():
    from services.worker import engine_config
    s = Settings.from_env({"TANDEM_KV_BUDGET_MB": "256", "TANDEM_KV_BUDGET_MB_CPU_DECODE": "30"})
    assert engine_config(s, "cpu", subjects.CPU_DECODE).kv_cache_bytes == 30 << 20
    assert engine_config(s, "cpu", subjects.PREFILL).kv_cache_bytes == 256 << 20


def test_max_seqs_sets_the_engine_s_slots_and_its_step_room():
    from services.worker import engine_config
    assert engine_config(Settings.from_env({}), "cpu", subjects.CPU_DECODE).max_num_seqs == 64
    c = engine_config(Settings.from_env({"TANDEM_MAX_SEQS": "200"}), "cpu", subjects.CPU_DECODE)
    assert (c.max_num_seqs, c.step_tokens) == (200, 200)      # a decode step holds a token of each
    c = engine_config(Settings.from_env({"TANDEM_MAX_SEQS": "4"}), "cuda", subjects.GPU_DECODE)
    assert (c.max_num_seqs, c.step_tokens) == (4, 512)
    with pytest.raises(ValueError, match="TANDEM_STEP_TOKENS must be 0 .* or >= 200"):
        Settings.from_env({"TANDEM_MAX_SEQS": "200", "TANDEM_STEP_TOKENS": "128"})
    with pytest.raises(ValueError, match="TANDEM_MAX_SEQS must be >= 0"):
        Settings.from_env({"TANDEM_MAX_SEQS": "-1"})
