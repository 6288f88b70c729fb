"""Fast CPU Q4_0 kernels: the C++ in ``q4_0_cpu.cpp``, built on first use, called via ctypes.

Same signatures as the reference (``kernels.q4_0``): ``matmul(x, q, out=None)`` and
``embedding(ids, q)``. Life cycle of the library:

1. first call → ``_library()`` hashes the source + compiler + flags into a file name under
   ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem/kernels/``);
2. cache hit → load it; miss → compile to a temporary file and rename it into place
   (atomic, so processes building at once are safe), then load it;
3. no compiler, a failed build or a failed load → one warning, and every call here runs
   the torch reference instead (``available()`` is then False).

Numerics: two activation modes. ``f32`` (default): each weight block is dequantized to f32
and FMA'd against the f32 activations (no activation rounding; only fp32 summation order differs
from the reference). ``q8``: activations are quantized to Q8_0 per call (as llama.cpp does), so
results differ from the f32 reference by that rounding (docs/kernels.md has the tolerance).
The same library holds the fused forward step (``forward_cpu.cpp``, driven by ``cpu_forward.py``).
Every output element is computed in the same order whatever M and the thread count, so a
row of a batched result is bitwise equal to the same row computed alone.

Environment: ``CXX`` (compiler, default ``g++``), ``TANDEM_CACHE_DIR``,
``TANDEM_CPU_ISA`` (``scalar``, ``avx2`` or ``avx512vnni``: cap the instruction set used;
default: the best the CPU has). Every path gives the same bits. ``TANDEM_CPU_ACT`` (``q8`` or
``f32``: the activation mode, default ``f32``; see ``set_act``). f32 activations keep the
logits within 0.07 of transformers fp32 on the bundled model (top-1 100 %); llama.cpp's Q8_0
activations are faster for prefill (~9 %) but flip near-ties (top-1 96 %): docs/kernels.md.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels import q4_0

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = (_HERE / "q4_0_cpu.cpp", _HERE / "forward_cpu.cpp")  # compiled into one library
HEADERS = (_HERE / "q4_0_cpu.h",)
CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
ABI_VERSION = 3
ACT_MODES = ("q8", "f32")
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512vnni"}  # the C++ ``Isa`` enum
_ISA_IDS = {v: k for k, v in ISA_NAMES.items()}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_num_threads: int | None = None  # None: follow torch.get_num_threads()


def cache_dir() -> Path:
    """Where built libraries live: ``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem/kernels``."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tandem" / "kernels"


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def library_path() -> Path:
    """The cached library file for the current source, compiler and flags."""
    key = hashlib.sha256()
    for f in (*SOURCES, *HEADERS):
        key.update(f.read_bytes())
    key.update("\0".join((_compiler(), *CXX_FLAGS)).encode())
    return cache_dir() / f"q4_0_cpu-{key.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    """Compile ``SOURCES`` to ``target`` atomically (temp file in the same dir + rename)."""
    cxx = _compiler()
    if shutil.which(cxx) is None:
        raise RuntimeError(f"C++ compiler {cxx!r} not found (set CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cxx, *CXX_FLAGS, *map(str, SOURCES), "-o", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.tq_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path} has ABI {lib.tq_abi_version()}, expected {ABI_VERSION}")
    i64, vp, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.tq_matmul.argtypes = [vp, vp, vp, i64, i64, i64, cint, cint]
    lib.tq_matmul.restype = None
    lib.tq_matmul_f32.argtypes = [vp, vp, vp, i64, i64, i64, cint, cint]
    lib.tq_matmul_f32.restype = None
    lib.tq_quantize_q8_0.argtypes = [vp, vp, vp, i64, i64, cint]
    lib.tq_quantize_q8_0.restype = None
    lib.tq_embedding.argtypes = [vp, i64, vp, i64, vp]
    lib.tq_embedding.restype = None
    lib.tq_best_isa.restype = cint
    lib.tq_forward.argtypes = [vp, vp, cint, cint]
    lib.tq_forward.restype = None
    return lib


def _library() -> ctypes.CDLL | None:
    """The loaded library, building it on first use; None (warned once) when that fails."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            path = library_path()
            if not path.exists():
                log.info("building Q4_0 CPU kernels: %s", path)
                _build(path)
            _lib = _load(path)
            log.info("Q4_0 CPU kernels loaded from %s (best path: %s)", path, ISA_NAMES[_lib.tq_best_isa()])
        except Exception as exc:  # any build/load failure → reference fallback
            _lib = None
            log.warning("fast Q4_0 CPU kernels unavailable, using the torch reference: %s", exc)
        _tried = True
        return _lib


def reload() -> bool:
    """Forget the loaded library and try again (tests; after changing CXX/cache dir)."""
    global _lib, _tried, _isa_choice, _act_choice
    with _lock:
        _lib, _tried = None, False
        _isa_choice = _isa_from_env()
        _act_choice = _act_from_env()
    return available()


def available() -> bool:
    """True when the compiled kernels are loaded (False: calls run the torch reference)."""
    return _library() is not None


def _isa_arg() -> int:
    """-1: the best path the CPU has; else the path ``TANDEM_CPU_ISA`` names (capped at the best)."""
    return _isa_choice


def _isa_from_env() -> int:
    return _ISA_IDS.get(os.environ.get("TANDEM_CPU_ISA", "").lower(), -1)


_isa_choice = _isa_from_env()


def _act_from_env() -> str:
    v = os.environ.get("TANDEM_CPU_ACT", "").strip().lower()
    if v in ("q8", "q8_0"):
        return "q8"
    if v in ("", "f32", "fp32", "float32"):
        return "f32"
    log.warning("ignoring TANDEM_CPU_ACT=%r (expected q8 or f32); using f32", v)
    return "f32"


_act_choice = _act_from_env()


def act() -> str:
    """The activation mode matmuls use: ``q8`` (Q8_0-quantized) or ``f32``."""
    return _act_choice


def set_act(mode: str | None) -> None:
    """Set the activation mode (``q8`` or ``f32``); None re-reads ``TANDEM_CPU_ACT``."""
    global _act_choice
    if mode is None:
        _act_choice = _act_from_env()
        return
    if mode not in ACT_MODES:
        raise ValueError(f"act must be one of {ACT_MODES}, got {mode!r}")
    _act_choice = mode


def isa() -> str:
    """The path the kernels use here: ``avx512vnni``, ``avx2``, ``scalar`` or ``reference``."""
    if _library() is None:
        return "reference"
    best = _lib.tq_best_isa()
    return ISA_NAMES[best if _isa_arg() < 0 else min(_isa_arg(), best)]


def set_num_threads(n: int | None) -> None:
    """Threads the kernels use; None follows ``torch.get_num_threads()`` (the default)."""
    global _num_threads
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"num_threads must be a positive int or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    return _num_threads if _num_threads is not None else torch.get_num_threads()


def _check_q(q: torch.Tensor) -> None:
    if not isinstance(q, torch.Tensor) or q.dtype != torch.uint8 or q.dim() != 2:
        raise ValueError(f"q must be a 2-D uint8 Q4_0 tensor, got {_describe(q)}")
    if q.device.type != "cpu" or not q.is_contiguous():
        raise ValueError(f"q must be a contiguous CPU tensor, got {_describe(q)}")
    if q.shape[1] % q4_0.BLOCK_BYTES:
        raise ValueError(f"q rows must be whole {q4_0.BLOCK_BYTES}-byte blocks, got shape {tuple(q.shape)}")


def _describe(t: object) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (non-contiguous)'}"


def matmul(x: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for float32 x [M, K] and Q4_0 bytes q [N, K/32*18] → float32 [M, N]."""
    return matmul_with(x, q, out, isa=None, num_threads=None)


def matmul_with(x: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None, *,
                isa: str | None = None, num_threads: int | None = None,
                act: str | None = None) -> torch.Tensor:
    """``matmul`` on a named instruction-set path, thread count and activation mode (``q8`` or
    ``f32``; tests, benchmarks); None keeps the configured one. A path the CPU lacks runs the
    best one it has."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"x must be a 2-D float32 tensor, got {_describe(x)}")
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous CPU tensor, got {_describe(x)}")
    _check_q(q)
    m, k = x.shape
    n = q.shape[0]
    if k % q4_0.QK or q.shape[1] != k // q4_0.QK * q4_0.BLOCK_BYTES:
        raise ValueError(f"x width {k} does not match q rows of {q.shape[1]} bytes")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32)
    elif (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or tuple(out.shape) != (m, n)
          or out.device.type != "cpu" or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous float32 CPU tensor of shape {(m, n)}, got {_describe(out)}")
    lib = _library()
    if lib is None:
        return q4_0.matmul(x, q, out=out)
    if isa is not None and isa not in _ISA_IDS:
        raise ValueError(f"isa must be one of {sorted(_ISA_IDS)}, got {isa!r}")
    if act is not None and act not in ACT_MODES:
        raise ValueError(f"act must be one of {ACT_MODES}, got {act!r}")
    fn = lib.tq_matmul_f32 if (act or _act_choice) == "f32" else lib.tq_matmul
    if m and n:
        fn(x.data_ptr(), q.data_ptr(), out.data_ptr(), m, n, k,
           num_threads or get_num_threads(), _isa_arg() if isa is None else _ISA_IDS[isa])
    return out


def embedding(ids: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a Q4_0 table as float32 [len(ids), K] (bitwise equal to the reference)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.device.type != "cpu":
        raise ValueError(f"ids must be an int64/int32 CPU tensor, got {_describe(ids)}")
    _check_q(q)
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    n = q.shape[0]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise ValueError(f"ids must lie in [0, {n}), got range [{int(flat.min())}, {int(flat.max())}]")
    lib = _library()
    if lib is None:
        return q4_0.embedding(flat, q)
    k = q.shape[1] // q4_0.BLOCK_BYTES * q4_0.QK
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    if flat.numel():
        lib.tq_embedding(flat.data_ptr(), flat.numel(), q.data_ptr(), k, out.data_ptr())
    return out


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization the matmul uses: x [M, K] f32 → (int8 [M, K], f32 scales [M, K/32]).

    Exposed for tests; raises RuntimeError when the compiled library is unavailable.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D float32 tensor, got {_describe(x)}")
    m, k = x.shape
    if k % q4_0.QK:
        raise ValueError(f"x width must be a multiple of {q4_0.QK}, got {k}")
    lib = _library()
    if lib is None:
        raise RuntimeError("the compiled Q4_0 CPU kernels are not available")
    qs = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // q4_0.QK, dtype=torch.float32)
    lib.tq_quantize_q8_0(x.data_ptr(), qs.data_ptr(), d.data_ptr(), m, k, _isa_arg())
    return qs, d
