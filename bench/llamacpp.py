"""llama.cpp for side-by-side benchmarks: install ``llama-cpp-python`` into its own venv, run it.

The package is not a dependency of Tandem (nor of its tests): ``ensure_installed()`` creates
``$TANDEM_CACHE_DIR/../llama-cpp-venv`` (default ``~/.cache/tandem/llama-cpp-venv``) on request and
builds the package there from source for this CPU (``-DGGML_NATIVE=ON``; ~10+ minutes on 2
cores, progress on stderr, full log next to the venv). On a CPU with AMX the build leaves
llama.cpp's AMX kernels out (``-mno-amx-*``, venv ``llama-cpp-venv-noamx``): in 0.3.36 they crash
(SIGSEGV in ``llama_decode``) on the bundled model for any batch of more than one token, so
llama.cpp's best path that runs there is its AVX-512 VNNI one with the Q4_0 repacking. ``run()`` runs ``llamacpp_runner.py``
in that venv on a GGUF and returns its JSON.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, pinned so reruns compare the same llama.cpp
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # explicit -mno-* win over -march=native


def has_amx() -> bool:
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def cmake_args() -> str:
    """``CMAKE_ARGS``, with AMX left out on AMX CPUs and ``TANDEM_LLAMA_CPP_CFLAGS`` added (e.g.
    ``-mno-avx512f -mno-avxvnni`` with ``TANDEM_LLAMA_CPP_VENV`` elsewhere: llama.cpp as an AVX2-only
    CPU runs it, to hold ``TANDEM_CPU_ISA=avx2`` against)."""
    flags = " ".join(f for f in (NO_AMX if has_amx() else "", os.environ.get("TANDEM_LLAMA_CPP_CFLAGS", "")) if f)
    if not flags:
        return CMAKE_ARGS
    return f'{CMAKE_ARGS} -DCMAKE_C_FLAGS="{flags}" -DCMAKE_CXX_FLAGS="{flags}"'
RUNNER = Path(__file__).with_name("llamacpp_runner.py")


def venv_dir() -> Path:
    env = os.environ.get("TANDEM_LLAMA_CPP_VENV")
    return Path(env) if env else Path.home() / ".cache" / "tandem" / ("llama-cpp-venv" + ("-noamx" if has_amx() else ""))


def _python() -> Path:
    return venv_dir() / "bin" / "python"


def installed() -> bool:
    py = _python()
    return py.exists() and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0


def _say(msg: str) -> None:
    sys.stderr.write(f"[llama.cpp] {msg}\n")
    sys.stderr.flush()


def ensure_installed() -> Path:
    """The venv's python, building llama-cpp-python into it first if needed (RuntimeError on
    failure). Concurrent callers (two benchmarks started together) build it once: the others
    wait on a lock file beside the venv."""
    if installed():
        return _python()
    venv = venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.with_name(venv.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed():  # built by whoever held the lock
            return _python()
        return _build(venv)


def _build(venv: Path) -> Path:
    log_path = venv.with_name(venv.name + "-build.log")
    _say(f"installing llama-cpp-python=={VERSION} into {venv} (compiles llama.cpp, ~10+ min on 2 cores); "
         f"log: {log_path}")
    if not _python().exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, CMAKE_ARGS=cmake_args(), CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    cmd = [str(_python()), "-m", "pip", "install", "--no-cache-dir", "-v", f"llama-cpp-python=={VERSION}"]
    step = re.compile(r"\[(\d+)/(\d+)\]")
    last = None
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            m = step.search(line)
            if m and m.group(1) != last and (int(m.group(1)) % 10 == 0 or m.group(1) == m.group(2)):
                last = m.group(1)
                _say(f"build step {m.group(1)}/{m.group(2)}")
        rc = proc.wait()
    if rc != 0 or not installed():
        raise RuntimeError(f"installing llama-cpp-python failed (exit {rc}); see {log_path}")
    _say("installed")
    return _python()


def run(gguf: str, threads: int, reps: int, tg: int, pp: int, batch_seqs: int, batch_ctx: int,
        batch_gen: int, long_pp: list[int] = (), ctx_tg: int = 0, ctx_gen: int = 64) -> dict:
    """Run the llama.cpp side on ``gguf`` (installing it first if needed) and return its figures."""
    py = ensure_installed()
    cmd = [str(py), str(RUNNER), gguf, "--threads", str(threads), "--reps", str(reps), "--tg", str(tg),
           "--pp", str(pp), "--batch-seqs", str(batch_seqs), "--batch-ctx", str(batch_ctx),
           "--batch-gen", str(batch_gen), "--ctx-tg", str(ctx_tg), "--ctx-gen", str(ctx_gen)]
    if long_pp:
        cmd += ["--long-pp", *map(str, long_pp)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"llama.cpp runner failed (exit {res.returncode}):\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])
