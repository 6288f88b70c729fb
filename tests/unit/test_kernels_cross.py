"""The q16 kernels' instruction-set paths against the scalar path, as standalone programs
(tests/native/q16_paths.cpp includes kernels/q4_0_cpu.cpp): on this CPU (AVX-512 / AVX2), and
built for aarch64 and run under qemu-user where a cross compiler and qemu exist — the NEON
dot-product path is the one the ARM hosts of a GPU box (Grace, Graviton) run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "native" / "q16_paths.cpp"
FLAGS = ["-O2", "-std=c++17", "-fopenmp", "-ffp-contract=off"]


def build_and_run(cxx: str, tmp_path: Path, runner: list[str]) -> subprocess.CompletedProcess:
    exe = tmp_path / "q16_paths"
    build = subprocess.run([cxx, *FLAGS, str(SRC), "-o", str(exe)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    return subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)


def test_every_path_of_this_cpu_gives_the_scalar_bits(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    res = build_and_run("g++", tmp_path, [])
    if res.returncode == 2:
        pytest.skip(f"this CPU runs only the scalar path: {res.stdout.strip()}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "bitwise equal" in res.stdout


def test_neon_path_under_qemu_gives_the_scalar_bits(tmp_path):
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if cxx is None or qemu is None:
        pytest.skip("needs aarch64-linux-gnu-g++ and qemu-aarch64 (Debian: g++-aarch64-linux-gnu qemu-user)")
    res = build_and_run(cxx, tmp_path, [qemu, "-L", "/usr/aarch64-linux-gnu"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("isa 3:")   # the NEON dot-product path ran (qemu's cpu has it)
