"""Fast CPU Q4_0 kernels: the C++ in ``q4_0_cpu.cpp``, built on first use, called via ctypes.

Same signatures as the reference (``kernels.q4_0``): ``matmul(x, q, out=None)`` and
``embedding(ids, q)``. Life cycle of the library:

1. first call → ``_library()`` hashes the source + compiler + flags into a file name under
   ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem/kernels/``);
2. cache hit → load it; miss → compile to a temporary file and rename it into place
   (atomic, so processes building at once are safe), then load it;
3. no compiler, a failed build or a failed load → one warning, and every call here runs
   the torch reference instead (``available()`` is then False).

Numerics: three activation modes (``TANDEM_CPU_ACT``, ``set_act``):

- ``q16`` (default): the engine repacks each weight matrix once at load (``prepare`` →
  ``PackedQ4``: the same Q4_0 values in groups of 16 rows, so SIMD lanes are rows) and every
  matmul quantizes its activations per 32 values to int16 (scale amax/32767): exact integer dot
  products (VNNI ``vpdpwssd`` / AVX2 ``vpmaddwd``), then one f32 fma per block. The int16 rounding
  is ~2^-16 of a block's largest activation; on the bundled model the greedy tokens equal the f32
  reference's and the logits stay within a few 0.01 (docs/kernels.md).
- ``f32``: each weight block dequantized to f32 and FMA'd against the f32 activations (no
  activation rounding; only the fp32 summation order differs from the reference). Also what a
  plain (unpacked) weight tensor gets in ``q16`` mode.
- ``q8``: activations quantized to Q8_0 per call (as llama.cpp does): fast, but near-ties flip.

The same library holds the fused forward step (``forward_cpu.cpp``, driven by ``cpu_forward.py``).
Every output element is computed in the same order whatever M and the thread count, so a
row of a batched result is bitwise equal to the same row computed alone.

Environment: ``CXX`` (compiler, default ``g++``), ``TANDEM_CXXFLAGS`` (extra compiler flags, part
of the cache key), ``TANDEM_CACHE_DIR``,
``TANDEM_CPU_ISA`` (``scalar``, ``avx2``, ``avx512vnni``, ``amx`` — AVX-512 VNNI plus q16 batches on
Intel's tile unit — or, on ARM, ``neon``: cap the instruction set used; default: the best the CPU
has). Every path gives the same bits. ``TANDEM_CPU_ACT`` (``q16``,
``f32`` or ``q8``: the activation mode, default ``q16``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels import q4_0

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = (_HERE / "q4_0_cpu.cpp", _HERE / "forward_cpu.cpp", _HERE / "sample_cpu.cpp")  # compiled into one library
HEADERS = (_HERE / "q4_0_cpu.h",)
CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
ABI_VERSION = 4
ACT_MODES = ("q16", "f32", "q8")
GROUP = 16  # rows per group of the packed layout (tq::GROUP)
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512vnni", 3: "neon", 4: "amx"}  # the C++ ``Isa`` enum
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


def _cxx_flags() -> tuple[str, ...]:
    """``CXX_FLAGS`` plus ``TANDEM_CXXFLAGS`` (e.g. ``-DTQ_ONE_CLONE=...``: tests build one clone alone)."""
    return (*CXX_FLAGS, *shlex.split(os.environ.get("TANDEM_CXXFLAGS", "")))


def library_path() -> Path:
    """The cached library file for the current source, compiler and flags."""
    key = hashlib.sha256()
    for f in (*SOURCES, *HEADERS):
        key.update(f.read_bytes())
    key.update("\0".join((_compiler(), *_cxx_flags())).encode())
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
        cmd = [cxx, *_cxx_flags(), *map(str, SOURCES), "-o", tmp]
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
    lib.tq_matmul_q16.argtypes = [vp, vp, vp, i64, i64, i64, cint, cint]
    lib.tq_matmul_q16.restype = None
    lib.tq_quantize_q16.argtypes = [vp, vp, vp, vp, i64, i64]
    lib.tq_quantize_q16.restype = None
    for name in ("tq_pack_q4_0", "tq_unpack_q4_0"):
        getattr(lib, name).argtypes = [vp, i64, i64, vp]
        getattr(lib, name).restype = None
    lib.tq_embedding_packed.argtypes = [vp, i64, vp, i64, vp]
    lib.tq_embedding_packed.restype = None
    lib.tq_best_isa.restype = cint
    lib.tq_resolve_isa.argtypes = [cint]
    lib.tq_resolve_isa.restype = cint
    lib.tq_forward.argtypes = [vp, vp, cint, cint]
    lib.tq_forward.restype = None
    lib.tq_ring_stage.argtypes = [vp, vp, cint, i64, vp, vp, vp, i64, i64, i64, i64, cint, cint]
    lib.tq_ring_stage.restype = cint
    lib.tq_sample_rows.argtypes = [vp, i64, i64, vp, vp, vp, vp, vp, vp, vp, vp, cint]
    lib.tq_sample_rows.restype = None
    lib.tq_philox_uniform.argtypes = [ctypes.c_uint64, i64]
    lib.tq_philox_uniform.restype = ctypes.c_double
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
    v = os.environ.get("TANDEM_CPU_ISA", "").strip().lower()
    if v and v not in _ISA_IDS:
        log.warning("ignoring TANDEM_CPU_ISA=%r (expected one of %s); using the best path the CPU has",
                    v, ", ".join(ISA_NAMES.values()))
    return _ISA_IDS.get(v, -1)


_isa_choice = _isa_from_env()


def _act_from_env() -> str:
    v = os.environ.get("TANDEM_CPU_ACT", "").strip().lower()
    if v in ("q8", "q8_0"):
        return "q8"
    if v in ("f32", "fp32", "float32"):
        return "f32"
    if v in ("", "q16", "int16"):
        return "q16"
    log.warning("ignoring TANDEM_CPU_ACT=%r (expected q16, f32 or q8); using q16", v)
    return "q16"


_act_choice = _act_from_env()


def act() -> str:
    """The activation mode: ``q16`` (packed weights, int16 activations), ``f32`` or ``q8``."""
    return _act_choice


def set_act(mode: str | None) -> None:
    """Set the activation mode (``q16``, ``f32`` or ``q8``); None re-reads ``TANDEM_CPU_ACT``.
    Weights packed by ``prepare`` keep running q16 whatever the mode."""
    global _act_choice
    if mode is None:
        _act_choice = _act_from_env()
        return
    if mode not in ACT_MODES:
        raise ValueError(f"act must be one of {ACT_MODES}, got {mode!r}")
    _act_choice = mode


def isa() -> str:
    """The path the kernels use here: ``amx``, ``avx512vnni``, ``avx2``, ``neon``, ``scalar`` or ``reference``."""
    if _library() is None:
        return "reference"
    return ISA_NAMES[_lib.tq_resolve_isa(_isa_arg())]


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


class PackedQ4:
    """A Q4_0 matrix [N, K] in the q16 kernels' layout (``tq_pack_q4_0``): per group of 16 rows
    and block of 32 weights, the 16 fp16 scales, then byte j of each of the 16 rows for j < 16.
    The same values and the same number of bytes as the row-major Q4_0 tensor it came from
    (plus padding rows up to a multiple of 16); ``unpack`` gives that tensor back. ``shape`` is
    the row-major tensor's, so code that reads sizes needs no change."""

    __slots__ = ("data", "n", "k")

    def __init__(self, data: torch.Tensor, n: int, k: int):
        self.data, self.n, self.k = data, n, k

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k // q4_0.QK * q4_0.BLOCK_BYTES))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def numel(self) -> int:
        return self.data.numel()

    def element_size(self) -> int:
        return 1

    def data_ptr(self) -> int:
        return self.data.data_ptr()

    def unpack(self) -> torch.Tensor:
        """The row-major Q4_0 bytes [N, K/32*18]."""
        out = torch.empty(self.shape, dtype=torch.uint8)
        if self.n:
            _checked_library().tq_unpack_q4_0(self.data.data_ptr(), self.n, self.k, out.data_ptr())
        return out

    def __repr__(self) -> str:
        return f"PackedQ4(n={self.n}, k={self.k}, {self.data.numel()} bytes)"


def _checked_library() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise RuntimeError("the compiled Q4_0 CPU kernels are not available")
    return lib


def pack(q: torch.Tensor) -> PackedQ4:
    """Row-major Q4_0 bytes [N, K/32*18] → ``PackedQ4`` (RuntimeError without the library)."""
    _check_q(q)
    n, k = q.shape[0], q.shape[1] // q4_0.BLOCK_BYTES * q4_0.QK
    groups = -(-n // GROUP)
    data = torch.empty(groups * GROUP * q.shape[1], dtype=torch.uint8)
    if n:
        _checked_library().tq_pack_q4_0(q.data_ptr(), n, k, data.data_ptr())
    return PackedQ4(data, n, k)


def prepare(q: torch.Tensor) -> torch.Tensor | PackedQ4:
    """The form ``matmul`` runs fastest on in the current mode: a ``PackedQ4`` in ``q16`` mode
    (when the library is loaded), else ``q`` itself. The engine calls it once per weight matrix."""
    if _act_choice == "q16" and available() and isinstance(q, torch.Tensor) and q.device.type == "cpu":
        return pack(q.contiguous())
    return q


def weight_layout() -> str:
    """What ``prepare`` makes of a weight matrix now: ``q16`` (``PackedQ4``) or ``rows`` (itself)."""
    return "q16" if _act_choice == "q16" and available() else "rows"


def matmul(x: torch.Tensor, q: torch.Tensor | PackedQ4, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for float32 x [M, K] and Q4_0 weights (bytes [N, K/32*18] or ``PackedQ4``) → float32 [M, N]."""
    return matmul_with(x, q, out, isa=None, num_threads=None)


def matmul_with(x: torch.Tensor, q: torch.Tensor | PackedQ4, out: torch.Tensor | None = None, *,
                isa: str | None = None, num_threads: int | None = None,
                act: str | None = None) -> torch.Tensor:
    """``matmul`` on a named instruction-set path, thread count and activation mode (tests,
    benchmarks); None keeps the configured one. A ``PackedQ4`` always runs q16; a row-major
    tensor runs ``f32`` or ``q8`` (``q16`` → ``f32``). A path the CPU lacks runs the best one it has."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"x must be a 2-D float32 tensor, got {_describe(x)}")
    if x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous CPU tensor, got {_describe(x)}")
    packed = isinstance(q, PackedQ4)
    if not packed:
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
        return q4_0.matmul(x, q, out=out)   # a PackedQ4 exists only where the library loaded
    if isa is not None and isa not in _ISA_IDS:
        raise ValueError(f"isa must be one of {sorted(_ISA_IDS)}, got {isa!r}")
    if act is not None and act not in ACT_MODES:
        raise ValueError(f"act must be one of {ACT_MODES}, got {act!r}")
    if packed:
        fn = lib.tq_matmul_q16
    else:
        fn = lib.tq_matmul if (act or _act_choice) == "q8" else lib.tq_matmul_f32
    if m and n:
        fn(x.data_ptr(), q.data_ptr(), out.data_ptr(), m, n, k,
           num_threads or get_num_threads(), _isa_arg() if isa is None else _ISA_IDS[isa])
    return out


def embedding(ids: torch.Tensor, q: torch.Tensor | PackedQ4) -> torch.Tensor:
    """Rows ``ids`` of a Q4_0 table (row-major or ``PackedQ4``) as float32 [len(ids), K]
    (bitwise equal to the reference)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.device.type != "cpu":
        raise ValueError(f"ids must be an int64/int32 CPU tensor, got {_describe(ids)}")
    packed = isinstance(q, PackedQ4)
    if not packed:
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
        fn = lib.tq_embedding_packed if packed else lib.tq_embedding
        fn(flat.data_ptr(), flat.numel(), q.data_ptr(), k, out.data_ptr())
    return out


def _check_activations(x: torch.Tensor) -> tuple[int, int]:
    """(M, K) of a contiguous 2-D float32 activation tensor whose width is whole blocks."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D float32 tensor, got {_describe(x)}")
    m, k = x.shape
    if k % q4_0.QK:
        raise ValueError(f"x width must be a multiple of {q4_0.QK}, got {k}")
    return m, k


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantization the matmul uses: x [M, K] f32 → (int8 [M, K], f32 scales [M, K/32]).

    Exposed for tests; raises RuntimeError when the compiled library is unavailable.
    """
    m, k = _check_activations(x)
    lib = _checked_library()
    qs = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // q4_0.QK, dtype=torch.float32)
    lib.tq_quantize_q8_0(x.data_ptr(), qs.data_ptr(), d.data_ptr(), m, k, _isa_arg())
    return qs, d


def quantize_q16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q16 activation quantization: x [M, K] f32 → (int16 [M, K], f32 scales [M, K/32],
    int32 block sums [M, K/32]), unpacked from the kernel's byte-quad layout. Exposed for tests;
    RuntimeError when the compiled library is unavailable."""
    m, k = _check_activations(x)
    lib = _checked_library()
    nb = k // q4_0.QK
    quads = torch.empty(m, nb, 16, dtype=torch.int32)
    d = torch.empty(m, nb, dtype=torch.float32)
    sums = torch.empty(m, nb, dtype=torch.int32)
    lib.tq_quantize_q16(x.data_ptr(), quads.data_ptr(), d.data_ptr(), sums.data_ptr(), m, k)
    # per block and step s: 4 dwords (xh, xl of k = 4s..4s+3, then xh, xl of k = 4s+16..4s+19)
    b = quads.view(torch.int8).reshape(m, nb, 4, 2, 2, 4).to(torch.int32)   # [s, low/high quad, xh/xl, c]
    xq = 256 * b[..., 0, :] + b[..., 1, :]                                  # [m, nb, s, quad, c]
    xq = xq.permute(0, 1, 3, 2, 4).reshape(m, nb, 32)                       # k = 16 quad + 4s + c
    return xq.to(torch.int16).reshape(m, k), d, sums
