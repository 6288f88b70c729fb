"""`tandem bench crossover` end to end on the real stack (two topologies, two levels, tiny
requests): it starts each topology, loads it, and writes the table, the plot and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_crossover_runs_two_topologies(tmp_path):
    env = dict(os.environ, TANDEM_KV_BUDGET_MB="64", TANDEM_HEARTBEAT_INTERVAL="0.5", PYTHONUNBUFFERED="1")
    env.pop("TANDEM_NATS_URL", None)
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "crossover", "--topologies", "single", "replicated",
         "--concurrency", "1", "2", "--max-tokens", "4", "--num-requests", "2", "--warmup", "1",
         "--json", str(tmp_path / "x.json"), "--plot", str(tmp_path / "x.png")],
        env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| output tok/s \\ conc. | single | replicated |" in out.stdout
    assert "every pool, gpu-decode included, runs on the CPU" in out.stdout or "CUDA:" in out.stdout
    res = json.loads((tmp_path / "x.json").read_text())
    assert [(r["system"], r["concurrency"]) for r in res["runs"]] == [
        ("single", 1), ("single", 2), ("replicated", 1), ("replicated", 2)]
    assert all(r["errors"] == 0 and r["output_tokens"] == r["requests"] * 4 for r in res["runs"])
    assert {t for r in res["runs"] for t in r["per_tier"]} <= {"interactive", "standard", "batch"}
    assert res["config"]["energy"]
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"
