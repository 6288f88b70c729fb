"""The tile of each fused-step Q4_0 matmul (``qmatmul`` in kernels/gpu_triton.py), per GPU.

A tile is (BLOCK_N weight rows a program, BLOCK_B Q4_0 blocks a K step, warps, splits over K,
up to how many rows the ``tl.dot``-free ``qgemv`` kernel runs instead of ``qmatmul`` — decode
batches — and the values a step of qgemv's RMSNorm prologue).
It is chosen from the weight's (N, K) only, never from the batch's M: a row's sum must not
depend on its batch (kernels/gpu_step.py), so the graphs' padded buckets and the eager step give
the same bits. The one bound in M is ``gemv``: batches up to it run qgemv, larger ones qmatmul,
each batch-invariant on its side (a row alone and in a batch of 16 alike; in a batch of 17 it
goes through the other kernel). A graph bucket and the eager step at the same rows take the
same side.

Where the tiles come from:
- ``TANDEM_GPU_TUNING=FILE``: a table written by ``python -m bench.gpu_tune --out FILE`` on the
  GPU at hand (``none``: the built-in rule below);
- else ``kernels/tuning/<device name>.json`` where one ships for ``torch.cuda.get_device_name()``
  (``NVIDIA H200`` -> ``NVIDIA_H200.json``), measured on that card;
- else the built-in rule (``rule``): 64 rows, one block a step, 4 warps, K split until the grid
  has 256 programs — the shape of the tiles the H200's sweep chose (docs/kernels.md: q|k|v's and
  the lm head's exactly; the old rule, 16 rows, 8 warps and 128 programs, took twice as long there).

A table holds tiles for exact (N, K) shapes; a shape it lacks gets the rule. A shape's entry may
hold a second tile, ``decode``, for batches of up to ``DECODE_ROWS`` rows (decode steps of up to 16
sequences): the sweep chooses it from its times at 1 and 16 rows, and the main tile from 64, so
neither side pays for the other's best (one tile for every M was the sweep's compromise until
2026-11-29). Each row's bits are then batch-invariant on its side of 16 rows, as with ``gemv``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).parent / "tuning"
DECODE_ROWS = 16     # batches of up to this many rows take a shape's ``decode`` tile where it has one
MIN_PROGRAMS = 256   # the rule: a matmul whose N gives fewer weight tiles than this splits K
WARPS = (4, 8)


@dataclass(frozen=True)
class Tile:
    block_n: int
    block_b: int
    warps: int
    splits: int        # wanted; ``plan`` rounds it so each split is whole K steps
    norm_w: int = 0    # qgemv: values a step of the RMSNorm prologue's sum of squares (0: 16 * block_b;
                       # qmatmul always 16 * block_b: a [64, 256] tile of it spills)
    gemv: int = 0      # up to this many rows (a power of two <= 16) run ``qgemv`` (no tl.dot); 0: never

    @property
    def norm_step(self) -> int:
        return self.norm_w or 16 * self.block_b

    def plan(self, n: int, k: int) -> tuple[int, int]:
        """(splits, Q4_0 blocks per split) for this tile over K inputs."""
        nb = k // 32
        splits = max(1, min(self.splits, nb // self.block_b))
        per = -(-(-(-nb // splits)) // self.block_b) * self.block_b
        return -(-nb // per), per


@dataclass(frozen=True)
class PrefillTile:
    """``attn_prefill``'s tile: query tokens a program (× the kv head's query heads as rows), keys a
    loop step, warps, and keys a segment (``seg``: a tile's keys split over programs of this many
    keys each, merged by the last to finish; 0: one program walks them all)."""
    block_q: int
    block_k: int
    warps: int
    seg: int


# by TANDEM_GPU_PREFILL_ATTN (the dots' precision): 16 tokens x 32 keys on the tensor cores (106-117
# registers with 8 warps; 3xTF32 192 with 4 warps, 232 with 8), x 16 keys in f32 "ieee" (205; 32 keys
# spilled 648 B); segments of 256 keys, as a decode token's (kernels/gpu_step.py SEG)
PREFILL = {"ieee": PrefillTile(16, 16, 8, 256), "tf32": PrefillTile(16, 32, 8, 256),
           "fp16": PrefillTile(16, 32, 8, 256), "tf32x3": PrefillTile(16, 32, 4, 256)}


def check_prefill(t: PrefillTile) -> PrefillTile:
    for name, lo, hi in (("block_q", 1, 128), ("block_k", 16, 256)):
        v = getattr(t, name)
        if v < lo or v & (v - 1) or v > hi:
            raise ValueError(f"prefill {name} {v} is not a power of two in {lo}..{hi}")
    if t.warps not in (2, 4, 8, 16):
        raise ValueError(f"prefill warps {t.warps} is not one of 2, 4, 8, 16")
    if t.seg and (t.seg % t.block_k or t.seg < t.block_k):
        raise ValueError(f"prefill seg {t.seg} is not 0 or a multiple of block_k {t.block_k}")
    if t.block_q * 4 < 16:
        raise ValueError("prefill block_q must give tl.dot at least 16 rows")
    return t


def prefill_tile_env(value: str) -> PrefillTile:
    """TANDEM_GPU_PREFILL_TILE=BLOCK_Q,BLOCK_K,WARPS,SEG (e.g. ``16,32,8,256``)."""
    try:
        return check_prefill(PrefillTile(*(int(v) for v in value.split(","))))
    except (TypeError, ValueError) as e:
        raise ValueError(f"TANDEM_GPU_PREFILL_TILE={value!r}: want BLOCK_Q,BLOCK_K,WARPS,SEG "
                         f"(e.g. 16,32,8,256): {e}") from None


def rule(n: int, k: int) -> Tile:
    block_n = 64
    tiles = -(-n // block_n)
    splits = 1
    if tiles < MIN_PROGRAMS and k // 32 >= 2:
        splits = min(-(-MIN_PROGRAMS // tiles), k // 32, 64)
    return Tile(block_n, 1, 4, splits)


def check(t: Tile) -> Tile:
    for name in ("block_n", "block_b"):
        v = getattr(t, name)
        if v < 1 or v & (v - 1) or v > 128:
            raise ValueError(f"{name} {v} is not a power of two in 1..128")
    if t.block_n < 16:
        raise ValueError(f"block_n {t.block_n} is under 16 (tl.dot's smallest tile)")
    if t.warps not in WARPS:
        raise ValueError(f"warps {t.warps} is not one of {WARPS}")
    if not 1 <= t.splits <= 64:
        raise ValueError(f"splits {t.splits} is not in 1..64")
    if t.norm_w and (t.norm_w < 16 or t.norm_w & (t.norm_w - 1) or t.norm_w > 1024):
        raise ValueError(f"norm_w {t.norm_w} is not 0 or a power of two in 16..1024")
    if t.gemv and (t.gemv & (t.gemv - 1) or t.gemv > 16):
        raise ValueError(f"gemv {t.gemv} is not 0 or a power of two up to 16")
    return t


class Tuning:
    """The tiles of one GPU: ``tile(n, k, m)``; ``source`` says where they came from. ``decode``:
    the shapes' tiles for batches of up to ``DECODE_ROWS`` rows, where they differ."""

    def __init__(self, tiles: dict[tuple[int, int], Tile] | None = None, source: str = "rule",
                 decode: dict[tuple[int, int], Tile] | None = None, prefill: dict[str, PrefillTile] | None = None):
        self.tiles = dict(tiles or {})
        self.decode = dict(decode or {})
        self.prefill = dict(prefill or {})     # precision -> attn_prefill's tile, where measured
        self.source = source

    def prefill_tile(self, precision: str) -> PrefillTile:
        """``attn_prefill``'s tile for dots in ``precision``: TANDEM_GPU_PREFILL_TILE, else the
        table's, else the built-in one."""
        env = os.environ.get("TANDEM_GPU_PREFILL_TILE", "").strip()
        if env:
            return prefill_tile_env(env)
        return self.prefill.get(precision) or PREFILL[precision]

    def tile(self, n: int, k: int, m: int) -> Tile:
        """The tile of an N x K weight's matmul over ``m`` rows."""
        return (m <= DECODE_ROWS and self.decode.get((n, k))) or self.tiles.get((n, k)) or rule(n, k)

    def to_json(self, **meta) -> dict:
        def entry(shape, t):
            return asdict(t) | ({"decode": asdict(self.decode[shape])} if shape in self.decode else {})
        return meta | {"tiles": {f"{n}x{k}": entry((n, k), t) for (n, k), t in sorted(self.tiles.items())}} | (
            {"prefill_attn": {p: asdict(t) for p, t in sorted(self.prefill.items())}} if self.prefill else {})

    @classmethod
    def from_json(cls, data: dict, source: str) -> "Tuning":
        if not isinstance(data, dict) or not isinstance(data.get("tiles"), dict):
            raise ValueError(f"{source}: not a tuning table (no 'tiles' object)")

        def tile(t) -> Tile:
            if not isinstance(t, dict):
                raise TypeError("a tile is an object {block_n, block_b, warps, splits[, norm_w, gemv]}")
            return check(Tile(**{f: int(t[f]) for f in ("block_n", "block_b", "warps", "splits")},
                              **{f: int(t.get(f, 0)) for f in ("norm_w", "gemv")}))
        tiles, decode = {}, {}
        for shape, t in data["tiles"].items():
            m = re.fullmatch(r"(\d+)x(\d+)", shape)
            if not m or not isinstance(t, dict):
                raise ValueError(f"{source}: bad entry {shape!r}: want 'NxK': {{block_n, block_b, warps, splits}}")
            key = (int(m[1]), int(m[2]))
            try:
                tiles[key] = tile(t)
                if "decode" in t:
                    decode[key] = tile(t["decode"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{source}: entry {shape}: {e}") from None
        prefill = {}
        for precision, t in (data.get("prefill_attn") or {}).items():
            try:
                if precision not in PREFILL:
                    raise ValueError(f"not one of {', '.join(PREFILL)}")
                prefill[precision] = check_prefill(PrefillTile(**{f: int(t[f]) for f in
                                                                  ("block_q", "block_k", "warps", "seg")}))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{source}: prefill_attn {precision!r}: {e}") from None
        return cls(tiles, source, decode, prefill)

    @classmethod
    def read(cls, path: str | Path) -> "Tuning":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the GPU tuning table {path}: {e}") from None
        return cls.from_json(data, str(path))


def shipped(device_name: str) -> Path:
    return HERE / (re.sub(r"[^A-Za-z0-9.-]+", "_", device_name.strip()) + ".json")


def load(device) -> Tuning:
    """The tiles for ``device`` (a torch.device), from TANDEM_GPU_TUNING, a shipped table or the rule."""
    env = os.environ.get("TANDEM_GPU_TUNING", "").strip()
    if env.lower() == "none":
        return Tuning()
    if env:
        return Tuning.read(env)
    if getattr(device, "type", None) == "cuda":
        import torch
        path = shipped(torch.cuda.get_device_name(device))
        if path.exists():
            return Tuning.read(path)
    return Tuning()
