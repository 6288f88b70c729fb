"""The decode graphs' bucket and padding logic (kernels/gpu_step.py), without a GPU or Triton."""

from __future__ import annotations

import pytest
import torch

from kernels import gpu_step, gpu_tuning
from kernels.gpu_step import DecodeInputs, bucket_for, buckets


def test_buckets_are_powers_of_two_up_to_the_cap():
    assert buckets(1) == [1]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    with pytest.raises(ValueError, match="max_seqs"):
        buckets(0)


@pytest.mark.parametrize("n,want", [(1, 1), (2, 2), (3, 4), (5, 8), (17, 32), (33, 48), (48, 48)])
def test_bucket_for_takes_the_smallest_that_holds(n, want):
    assert bucket_for(n, buckets(48)) == want


def test_bucket_for_refuses_more_rows_than_the_largest():
    with pytest.raises(ValueError, match="exceed the largest graph bucket 48"):
        bucket_for(49, buckets(48))


def test_split_depends_on_n_and_k_only_and_covers_k():
    rule = gpu_tuning.Tuning()

    def split_for(n, k):
        tile = rule.tile(n, k, 1)
        return (tile, *tile.plan(n, k))
    for n, k in [(576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576), (64, 1024), (100, 96)]:
        tile, splits, per = split_for(n, k)
        nb = k // 32
        assert per % tile.block_b == 0 and (splits - 1) * per < nb <= splits * per
        if -(-n // tile.block_n) >= gpu_tuning.MIN_PROGRAMS:
            assert splits == 1
    assert split_for(49152, 576) == (gpu_tuning.Tile(64, 1, 4, 1), 1, 18)   # the lm head: 768 tiles
    assert split_for(960, 576) == (gpu_tuning.Tile(64, 1, 4, 18), 18, 1)    # q|k|v: the H200's own tile
    assert split_for(576, 1536)[1] > 1            # down: 9 tiles of 64 rows, so K is split


@pytest.mark.parametrize("block_b,splits", [(1, 1), (2, 3), (4, 5), (8, 4), (8, 64), (4, 1)])
def test_a_tuned_tile_splits_k_into_whole_steps(block_b, splits):
    for k in (96, 576, 1536):
        t = gpu_tuning.Tile(32, block_b, 4, splits)
        got, per = t.plan(576, k)
        nb = k // 32
        assert per % block_b == 0 and (got - 1) * per < nb <= got * per and got <= splits


def test_weight_prefetch_where_a_program_has_steps_to_hide():
    """TANDEM_GPU_PREFETCH: auto prefetches programs of 3+ K steps up to 32 rows, not the split
    norm-prologue matmuls; 1 from 2 steps; 0 never; 64 rows never (it spilled)."""
    p = gpu_step.prefetch
    assert p(1, 18, 1) and p(32, 3, 1) and p(16, 8, 2)              # the lm head; 3 steps; 4 of two blocks
    assert not p(16, 2, 1) and not p(16, 1, 1) and not p(16, 4, 2)  # 2 steps, 1 step
    assert not p(16, 3, 1, norm_split=True) and p(16, 3, 1, "1", norm_split=True)
    assert p(16, 2, 1, "1") and not p(16, 1, 1, "1")
    assert not any(p(m, 18, 1, mode) for m in (33, 64) for mode in gpu_step.PREFETCH)
    assert not p(1, 18, 1, "0")


def test_prefetch_setting_is_checked(monkeypatch):
    from tests.unit.test_gpu_compile import bundled_shapes_model
    monkeypatch.setenv("TANDEM_GPU_PREFETCH", "2")
    with pytest.raises(ValueError, match="TANDEM_GPU_PREFETCH"):
        gpu_step.GpuStep(bundled_shapes_model(), 1024)


def test_pdl_setting_is_checked_and_only_cuda_takes_it(monkeypatch):
    """TANDEM_GPU_PDL: 0 / 1 / exit are the kernels' PDL 0 / 1 / 2 on CUDA sm_90+; on any other
    device plain launches (0) whatever it says; anything else is refused by name, everywhere."""
    from tests.unit.test_gpu_compile import bundled_shapes_model
    assert gpu_step.PDL_MODES == {"0": 0, "1": 1, "exit": 2}
    for value in ("0", "1", "exit"):
        monkeypatch.setenv("TANDEM_GPU_PDL", value)
        assert gpu_step.pdl_mode(torch.device("cpu")) == 0
    assert gpu_step.pdl_args(0) == {"PDL": 0} and gpu_step.pdl_args(2) == {"PDL": 2, "launch_pdl": True}
    monkeypatch.setenv("TANDEM_GPU_PDL", "late")
    with pytest.raises(ValueError, match="TANDEM_GPU_PDL must be one of 0, 1, exit"):
        gpu_step.pdl_mode(torch.device("cpu"))
    with pytest.raises(ValueError, match="TANDEM_GPU_PDL"):
        gpu_step.GpuStep(bundled_shapes_model(), 1024)


def test_tuning_tables_load_and_refuse_bad_entries(tmp_path, monkeypatch):
    t = gpu_tuning.Tuning({(960, 576): gpu_tuning.Tile(32, 4, 4, 2)}, "x")
    path = tmp_path / "t.json"
    path.write_text(__import__("json").dumps(t.to_json(device="test")))
    monkeypatch.setenv("TANDEM_GPU_TUNING", str(path))
    got = gpu_tuning.load(torch.device("cpu"))
    assert all(got.tile(960, 576, m) == gpu_tuning.Tile(32, 4, 4, 2) for m in (1, 16, 17, 512))
    assert got.source == str(path)
    assert got.tile(576, 576, 1) == gpu_tuning.rule(576, 576)       # a shape it lacks: the rule
    assert got.tile(960, 576, 1).norm_step == 64                    # no norm_w: 16 values a block a step
    path.write_text('{"tiles": {"960x576": {"block_n": 32, "block_b": 1, "warps": 4, "splits": 1, "norm_w": 256}}}')
    assert gpu_tuning.load(torch.device("cpu")).tile(960, 576, 1).norm_step == 256
    for bad in ('{"tiles": {"960x576": {"block_n": 24, "block_b": 4, "warps": 4, "splits": 1}}}',
                '{"tiles": {"960x576": {"block_n": 32, "block_b": 4, "warps": 3, "splits": 1}}}',
                '{"tiles": {"960x576": {"block_n": 32, "block_b": 1, "warps": 4, "splits": 1, "norm_w": 100}}}',
                '{"tiles": {"960x576": {"block_n": 32, "block_b": 1, "warps": 4, "splits": 1, "decode": 3}}}',
                '{"tiles": {"960x576": {"block_n": 32, "block_b": 1, "warps": 4, "splits": 1, '
                '"decode": {"block_n": 32, "block_b": 1, "warps": 4, "splits": 1, "gemv": 12}}}}',
                '{"tiles": {"960": {}}}', '{"tiles": {"960x576": {"block_n": 32}}}', "[1]", "not json"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="t.json"):
            gpu_tuning.load(torch.device("cpu"))
    monkeypatch.setenv("TANDEM_GPU_TUNING", "none")
    assert gpu_tuning.load(torch.device("cpu")).source == "rule"
    assert gpu_tuning.shipped("NVIDIA H200").name == "NVIDIA_H200.json"


def test_the_prefill_attention_tile_comes_from_the_setting_the_table_or_the_default(tmp_path, monkeypatch):
    P = gpu_tuning.PrefillTile
    monkeypatch.delenv("TANDEM_GPU_PREFILL_TILE", raising=False)
    t = gpu_tuning.Tuning({(960, 576): gpu_tuning.Tile(32, 1, 4, 2)}, "x", prefill={"fp16": P(32, 64, 4, 512)})
    path = tmp_path / "t.json"
    path.write_text(__import__("json").dumps(t.to_json(device="test")))
    monkeypatch.setenv("TANDEM_GPU_TUNING", str(path))
    got = gpu_tuning.load(torch.device("cpu"))
    assert got.prefill_tile("fp16") == P(32, 64, 4, 512)
    assert got.prefill_tile("ieee") == gpu_tuning.PREFILL["ieee"]           # not measured: the built-in tile
    assert gpu_tuning.Tuning().prefill_tile("tf32") == gpu_tuning.PREFILL["tf32"]
    monkeypatch.setenv("TANDEM_GPU_PREFILL_TILE", "64,128,8,0")
    assert got.prefill_tile("fp16") == got.prefill_tile("ieee") == P(64, 128, 8, 0)
    for bad in ("64,128,8", "64,100,8,0", "64,128,3,0", "64,128,8,100", "2,16,4,0", "a,b,c,d"):
        monkeypatch.setenv("TANDEM_GPU_PREFILL_TILE", bad)
        with pytest.raises(ValueError, match="TANDEM_GPU_PREFILL_TILE"):
            got.prefill_tile("ieee")
    monkeypatch.delenv("TANDEM_GPU_PREFILL_TILE")
    for bad in ('{"tiles": {}, "prefill_attn": {"fp8": {"block_q": 16, "block_k": 32, "warps": 8, "seg": 0}}}',
                '{"tiles": {}, "prefill_attn": {"fp16": {"block_q": 16, "block_k": 24, "warps": 8, "seg": 0}}}',
                '{"tiles": {}, "prefill_attn": {"fp16": {"block_q": 16}}}'):
        path.write_text(bad)
        with pytest.raises(ValueError, match="prefill_attn"):
            gpu_tuning.load(torch.device("cpu"))


def _tables():
    return [[7, 3], [5], [9, 2, 4]]


def test_fill_pads_rows_to_the_bucket_with_the_scratch_block():
    inp = DecodeInputs(cap=8, width=4, scratch_block=99, device="cpu")
    inp.fill([11, 12, 13], [17, 0, 40], _tables(), block_size=16, bucket=4)
    ids, pos, sblk, soff, tables, lens, rows = (t.tolist() for t in inp.args(4))
    assert ids == [11, 12, 13, 0] and pos == [17, 0, 40, 0]
    assert sblk == [3, 5, 4, 99] and soff == [1, 0, 8, 0]          # the slot of each new token
    assert lens == [18, 1, 41, 1] and rows == [0, 1, 2, 3]
    assert tables == [[7, 3, 99, 99], [5, 99, 99, 99], [9, 2, 4, 99], [99, 99, 99, 99]]


def test_fill_overwrites_a_larger_earlier_step():
    inp = DecodeInputs(cap=8, width=4, scratch_block=99, device="cpu")
    inp.fill([1] * 8, [3] * 8, [[6]] * 8, block_size=16, bucket=8)
    inp.fill([11, 12, 13], [17, 0, 40], _tables(), block_size=16, bucket=4)
    ids, _, sblk, _, tables, lens, _ = (t.tolist() for t in inp.args(4))
    assert ids[3] == 0 and sblk[3] == 99 and lens[3] == 1 and tables[3] == [99] * 4


def test_fill_refuses_bad_rows():
    inp = DecodeInputs(cap=4, width=2, scratch_block=9, device="cpu")
    with pytest.raises(ValueError, match="table width 2"):
        inp.fill([1], [40], [[1, 2, 3]], block_size=16, bucket=1)
    with pytest.raises(ValueError, match="one entry per row"):
        inp.fill([1, 2], [0], [[1], [2]], block_size=16, bucket=2)
    with pytest.raises(ValueError, match="bucket of 2"):
        inp.fill([1, 2, 3], [0, 0, 0], [[1], [2], [3]], block_size=16, bucket=2)


def test_modes_and_cpu_engines():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="gpu_step must be one of"):
        gpu_step.wanted(cpu, "fast")
    assert not gpu_step.wanted(cpu, "ops")


def test_unsupported_shapes_say_why():
    from tests.integration.test_gpu_step import tiny_config
    assert gpu_step.unsupported(tiny_config(), 16) is None
    assert "head_dim 24" in gpu_step.unsupported(tiny_config(head_dim=24), 16)
    assert "block size 12" in gpu_step.unsupported(tiny_config(), 12)


def test_a_decode_tile_takes_batches_of_up_to_16_rows(tmp_path, monkeypatch):
    """A shape's ``decode`` tile (bench/gpu_tune.py chooses it from 1 and 16 rows): batches up to
    16 rows take it, larger ones the main tile; it round-trips through the table's JSON."""
    main, dec = gpu_tuning.Tile(64, 1, 4, 11), gpu_tuning.Tile(32, 2, 8, 4, 256, 16)
    t = gpu_tuning.Tuning({(3072, 576): main, (576, 576): gpu_tuning.Tile(32, 1, 8, 8)}, "x", {(3072, 576): dec})
    path = tmp_path / "t.json"
    path.write_text(__import__("json").dumps(t.to_json(device="test")))
    monkeypatch.setenv("TANDEM_GPU_TUNING", str(path))
    got = gpu_tuning.load(torch.device("cpu"))
    assert [got.tile(3072, 576, m) for m in (1, 8, 16, 17, 64)] == [dec, dec, dec, main, main]
    assert got.tile(576, 576, 1) == got.tile(576, 576, 64) == gpu_tuning.Tile(32, 1, 8, 8)   # none: the main tile
    assert got.to_json() == t.to_json()


def test_the_sweep_chooses_the_decode_and_main_tiles_apart():
    """bench/gpu_tune.py: the decode tile from its times at 1 and 16 rows, the main one from 64;
    a tile not timed at every M of its side is not a choice."""
    from bench.gpu_tune import best_tile
    T = gpu_tuning.Tile
    a, b, c, d = T(64, 1, 4, 18), T(32, 2, 4, 4, 256, 16), T(16, 1, 8, 8), T(64, 2, 4, 9, 0, 16)
    times = {("qkv", 1, a): 10.0, ("qkv", 16, a): 11.0, ("qkv", 64, a): 20.0,
             ("qkv", 1, b): 5.0, ("qkv", 16, b): 9.0, ("qkv", 64, b): 40.0,     # qgemv: the decode side's best
             ("qkv", 1, c): 12.0, ("qkv", 16, c): 12.0, ("qkv", 64, c): 18.0,   # the 64-row side's best
             ("qkv", 1, d): 1.0, ("qkv", 64, d): 60.0}                          # (never timed at 16 rows)
    assert best_tile(times, [a, b, c, d], "qkv", [1, 16]) == b
    assert best_tile(times, [a, b, c, d], "qkv", [64]) == c
    assert best_tile(times, [a, b, c, d], "qkv", []) is None
    assert best_tile(times, [a, b, c, d], "o", [1]) is None


def test_the_sweep_times_the_shipped_tiles_right_after_the_rule():
    """A sweep its budget cuts short must not choose slower tiles than the card's shipped table:
    the rule's tile is timed first, then the shipped table's main and decode tiles for the shape
    (where they are candidates), then the rest, each once. The H200's shipped table's tiles are
    candidates of the sweep as it stands."""
    from bench.gpu_tune import SHAPES, candidates, shipped_tiles, sweep_order
    known = shipped_tiles("NVIDIA H200")
    assert set(known) == {v[:2] for v in SHAPES.values()}
    cands = {name: sorted(candidates(n, k, norm), key=lambda t: (t.block_b, -t.splits, t.gemv, t.norm_w,
                                                                 t.block_n, t.warps))
             for name, (n, k, norm, *_) in SHAPES.items()}
    order = sweep_order(cands, known)
    for name, (n, k, *_) in SHAPES.items():
        tiles = known[(n, k)]
        assert order[name][0] == gpu_tuning.rule(n, k)
        assert all(t in order[name][:1 + len(tiles)] for t in tiles), name
        assert sorted(order[name], key=repr) == sorted(set(cands[name]) | {gpu_tuning.rule(n, k)}, key=repr)
    # a decode tile that ships comes second too; a shipped tile that is no candidate is not timed
    T = gpu_tuning.Tile
    a, b, c = T(64, 1, 4, 18), T(32, 2, 4, 4, 256, 16), T(16, 8, 4, 1)
    rule = gpu_tuning.rule(960, 576)
    got = sweep_order({"qkv": [a, b]}, {(960, 576): [b, c]})["qkv"]
    assert got == list(dict.fromkeys([rule, b, a]))
    assert shipped_tiles("no such card") == {} and shipped_tiles("") == {}


@pytest.mark.slow
def test_the_sweep_runs_its_code_paths_in_the_interpreter(tmp_path):
    """`python -m bench.gpu_tune --dry-run` (Triton's interpreter, two tiles a shape, one row): it
    compiles, times, chooses and writes a table the engine reads (~100 s on 2 vCPUs)."""
    import subprocess
    import sys
    out = tmp_path / "tiles.json"
    r = subprocess.run([sys.executable, "-m", "bench.gpu_tune", "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| shape | N x K | rule tile | tuned tile | decode tile (≤ 16 rows) |" in r.stdout
    got = gpu_tuning.Tuning.read(out)
    assert got.tiles and got.tile(512, 1536, 1) in (gpu_tuning.rule(512, 1536), got.tiles[(512, 1536)])
