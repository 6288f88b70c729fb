"""Execution strategies: how a session's decode runs, chosen per session (docs/strategies.md).

    gpu           one gpu-decode worker (interactive sessions: fastest steps)
    cpu           one cpu-decode worker (background sessions that fit one worker's KV)
    cpu-ring(N)   N cpu-decode workers, each holding a SEG-aligned token range of the KV;
                  the queries travel (shared/ring/) — a context no single worker holds

``choose(tier, context_tokens, workers)`` is a pure function of what the router knows (each
live decode worker's role and free KV in tokens); ``shard_ranges`` is the ring's split, shared
by the policy (does it fit?) and the ring itself (where does each token go?). No I/O, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shared import subjects
from shared.tier import Tier

SEG = 256          # keys per attention segment (kernels/forward_cpu.cpp SEG): ring shards are SEG-aligned
MAX_RING = 8       # members of a ring at most
GPU, CPU, RING = "gpu", "cpu", "cpu-ring"
_RING_RE = re.compile(r"cpu-ring\((\d+)\)")


@dataclass(frozen=True)
class Strategy:
    kind: str                         # GPU | CPU | RING
    workers: tuple[str, ...]          # the worker (gpu, cpu) or the ring's members in shard order

    def __str__(self) -> str:
        return f"{RING}({len(self.workers)})" if self.kind == RING else self.kind

    @staticmethod
    def parse_kind(s: str) -> tuple[str, int]:
        """("gpu" | "cpu" | "cpu-ring", members) of a strategy's name; ValueError otherwise."""
        if s in (GPU, CPU):
            return s, 1
        m = _RING_RE.fullmatch(s)
        if not m or not 1 <= int(m.group(1)) <= MAX_RING:
            raise ValueError(f"strategy must be gpu, cpu or cpu-ring(N) with 1 <= N <= {MAX_RING}, got {s!r}")
        return RING, int(m.group(1))


@dataclass(frozen=True)
class PoolWorker:
    """A live decode worker as the policy sees it."""
    id: str
    role: str                         # "gpu-decode" | "cpu-decode"
    free_tokens: int                  # free KV blocks x block size
    max_context: int                  # the longest context its engine takes


class NoCapacity(RuntimeError):
    """No strategy can hold the session's KV now; the message says what was missing."""


def shard_ranges(total_tokens: int, n_members: int) -> list[tuple[int, int]]:
    """Contiguous token ranges [start, end) covering [0, total_tokens), one per member, each
    starting on a SEG boundary (a segment never spans two members, so the members' segment
    states are exactly the single worker's). The segments are dealt evenly, the first members
    taking one more where they do not divide; the last range ends at ``total_tokens``."""
    if n_members < 1:
        raise ValueError(f"a ring needs at least one member, got {n_members}")
    nseg = -(-total_tokens // SEG)
    if total_tokens < 1 or nseg < n_members:
        raise ValueError(f"{total_tokens} tokens are {nseg} segments of {SEG}: too few for a ring of {n_members}")
    base, extra = divmod(nseg, n_members)
    out, s = [], 0
    for i in range(n_members):
        e = s + base + (i < extra)
        out.append((s * SEG, min(e * SEG, total_tokens)))
        s = e
    return out


def _single(pool: list[PoolWorker], tokens: int) -> PoolWorker | None:
    """The worker of ``pool`` with the most free KV, if it holds ``tokens``."""
    fits = [w for w in pool if w.free_tokens >= tokens and w.max_context >= tokens]
    return max(fits, key=lambda w: (w.free_tokens, w.id)) if fits else None


def smallest_ring(cpus: list[PoolWorker], tokens: int, max_members: int) -> tuple[PoolWorker, ...] | None:
    """The smallest ring of cpu workers holding ``tokens``: the workers with the most free KV,
    the largest shard on the freest one."""
    by_free = sorted(cpus, key=lambda w: (-w.free_tokens, w.id))
    for n in range(2, min(max_members, len(by_free), -(-tokens // SEG)) + 1):
        ranges = shard_ranges(tokens, n)
        if all(w.free_tokens >= b - a for w, (a, b) in zip(by_free, ranges)):
            return tuple(by_free[:n])
    return None


def choose(tier: str, context_tokens: int, workers: list[PoolWorker], max_members: int = MAX_RING) -> tuple[Strategy, str]:
    """(strategy, reason) for a session of ``tier`` whose KV may reach ``context_tokens``
    (prompt + max new tokens). Interactive: gpu, else one cpu worker, else a ring (slow beats
    refused). Standard and batch: one cpu worker, else a ring of the fewest members that holds
    it, else the gpu pool. NoCapacity when nothing holds it."""
    if context_tokens < 1:
        raise ValueError(f"context_tokens must be >= 1, got {context_tokens}")
    gpus = [w for w in workers if w.role == subjects.GPU_DECODE]
    cpus = [w for w in workers if w.role == subjects.CPU_DECODE]
    gpu, cpu = _single(gpus, context_tokens), _single(cpus, context_tokens)
    ring = None if cpu else smallest_ring(cpus, context_tokens, max_members)
    order = [(GPU, gpu), (CPU, cpu), (RING, ring)] if tier == Tier.INTERACTIVE else [(CPU, cpu), (RING, ring), (GPU, gpu)]
    for kind, got in order:
        if got is None:
            continue
        members = got if kind == RING else (got,)
        s = Strategy(kind, tuple(w.id for w in members))
        if kind == RING:
            why = f"no single worker holds {context_tokens} tokens (most free: {max(w.free_tokens for w in cpus)})"
        else:
            why = f"{members[0].id} holds {context_tokens} tokens ({members[0].free_tokens} free)"
        return s, f"{tier} -> {s}: {why}"
    free = {w.id: w.free_tokens for w in workers}
    raise NoCapacity(f"no gpu or cpu worker, nor a ring of up to {max_members} cpu workers, holds "
                     f"{context_tokens} tokens of KV now (free tokens: {free or 'no workers'})")
