"""bench/gpu_prefill_tune.py: the prefill attention's tile sweep — its candidates compile for
sm_90 without spilling (the slow lane: ~3 min on 2 vCPUs), and its code paths run in Triton's
interpreter, writing a table the engine reads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (the test extra installs it)")

from kernels import gpu_tuning  # noqa: E402


def test_the_sweep_starts_with_the_built_in_tiles_and_mixes_the_precisions():
    from bench.gpu_prefill_tune import candidates
    c = candidates()
    assert c[:4] == [(p, gpu_tuning.PREFILL[p]) for p in ("ieee", "tf32", "fp16", "tf32x3")]
    assert len(c) == len(set(c))
    assert {p for p, _ in c[4:12]} == {"ieee", "tf32", "fp16", "tf32x3"}
    for _, t in c:
        gpu_tuning.check_prefill(t)


def test_the_sweep_runs_its_code_paths_in_the_interpreter(tmp_path):
    """`python -m bench.gpu_prefill_tune --dry-run` (a 96-token prompt, two tiles, one of them split
    over 32-key segments): it times, checks each against f32 without segments, chooses, and adds
    ``prefill_attn`` to an existing table, keeping its matmul tiles."""
    out = tmp_path / "tiles.json"
    out.write_text(json.dumps(gpu_tuning.Tuning({(960, 576): gpu_tuning.Tile(32, 1, 4, 2)}, "x").to_json()))
    r = subprocess.run([sys.executable, "-m", "bench.gpu_prefill_tune", "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| precision | block_q | block_k | warps | seg |" in r.stdout and "WRONG" not in r.stdout
    got = gpu_tuning.Tuning.read(out)
    assert got.tiles == {(960, 576): gpu_tuning.Tile(32, 1, 4, 2)}
    assert got.prefill == {"ieee": gpu_tuning.PREFILL["ieee"], "fp16": gpu_tuning.PrefillTile(16, 32, 4, 32)}


@pytest.mark.slow
def test_every_candidate_compiles_for_sm90_without_spills(tmp_path):
    """Each (precision, tile) the sweep times, as the JIT compiles it over a prompt whose tiles
    span segments (and, for the tiles without, one whose do not split): ptxas' spills within the
    bound the step's own kernels keep (tests/unit/test_gpu_compile.py)."""
    from bench import gpu_prefill_tune as P
    from kernels import gpu_step
    from tests.unit import test_gpu_compile as C
    rec = C.Recorder()
    mp = pytest.MonkeyPatch()
    mp.setattr(gpu_step, "_k", lambda: rec)
    mp.setattr(P, "DEVICE", "cpu")
    try:
        p = P.Prompt(600, 600)
        for precision, tile in P.candidates():
            p.run(precision, tile)
    finally:
        mp.undo()
    launches = list(rec.launches.values())
    assert {c["PSEG"] for _, _, c, *_ in launches} == {0, 128, 256, 512}
    C._compile_all(launches, tmp_path)
