"""The ring in one process: a session's KV split by token ranges over N members; the queries travel.

The "cpu-ring(N)" execution strategy (docs/strategies.md). KV stays where it was scattered;
each decode step the coordinator (which holds the weights) computes the new token's q|k|v per
layer, every member computes the softmax states of its key segments against q, and the
coordinator merges them in segment order — bitwise the single-worker step, because the fused
CPU attention is that same fold (``kernels/cpu_ring.py``).

Life cycle of a ring session:

    Plan       shard_ranges() (shared/strategy.py): SEG-aligned token ranges over the session's whole length
               (prompt + max new tokens), one per member, the last one open to growth
    Scatter    admit(): every member reserves KV blocks for its whole range (or the admission
               fails with RingCapacityError naming the member and the shortfall: nothing is
               kept), then the members load their slices of the prefill's KV bytes, all at once
    Decoding   step(): per layer q|k|v → the member owning the new position stores k, v →
               each member with keys attends its segments → merge + o-proj + FFN; logits
    Gather     gather(): the shards' bytes end to end = the session's KV in layout v1, the
               bytes a migration to a single worker moves; release() frees the members' blocks

Members are anything that speaks ``RingMember`` (the Protocol below): ``LocalMember`` objects in
the coordinator's process (the integration tests and ``tandem bench ring``), or proxies of
members in other cpu-decode workers (``shared/ring/remote.py``: the per-step messages on a
data-plane connection). A step
``post``s the layer's q|k|v to every member first and ``collect``s their states after, in shard
order: remote members attend while the coordinator's own member does. With ``fold`` the
members fold the states along the ring instead, remote ones passing the running state to the
next over links of their own, head group by head group (``groups``), the q rows broadcast or
passed along the ring (``qpass``): the coordinator receives one state per kv head.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from kernels.cpu_ring import SEG, RingKernels
from shared import metrics
from shared.engine.kv_cache import KV_DTYPE, BlockManager, KVBlobHeader, KVLayout
from shared.strategy import shard_ranges


class RingCapacityError(RuntimeError):
    """A ring (or one worker) cannot hold a session's KV: the message names who and by how much."""


@dataclass
class _Shard:
    start: int                 # first position held (a multiple of SEG)
    end: int                   # one past the last position this member may ever hold
    blocks: list[int]          # the member's blocks for [start, end), in order
    table: torch.Tensor        # block ids by absolute position (entries before start: blocks[0], never read)


@runtime_checkable
class RingMember(Protocol):
    """What ``Ring`` calls on a member, in this process (``LocalMember``) or another
    (``shared/ring/remote.RemoteMember``, the same calls as messages)."""
    name: str                  # the worker (or test member) it is, in errors and logs
    layout: KVLayout           # the KV layout of its shards

    def reserve(self, sid: str, start: int, end: int) -> None:
        """Blocks for positions [start, end) of ``sid``; RingCapacityError if they do not fit."""

    def load(self, sid: str, kv, first: int = 0) -> None:
        """Fill the shard's blocks from block ``first`` on with ``kv`` (whole blocks, layout v1)."""

    def owns(self, sid: str, pos: int) -> bool:
        """Whether position ``pos`` of ``sid`` is in this member's range."""

    def post(self, sid: str, layer: int, qkv: torch.Tensor, pos: int, store: bool) -> None:
        """A step's layer (``store``: it owns the new position); its states come from ``collect``."""

    def collect(self, sid: str) -> torch.Tensor | None:
        """The posted layer's states [kv heads, segments, part] (None: no keys here yet)."""

    def read(self, sid: str, keys: int) -> bytes:
        """The shard's blocks holding any of the first ``keys`` positions, as bytes."""

    def release(self, sid: str) -> None:
        """Free the shard (no error if it holds none)."""


class LocalMember:
    """One member in this process: a paged KV cache of its own budget holding a token range of
    ring sessions (a ``RingMember``)."""

    def __init__(self, kernels: RingKernels, layout: KVLayout, kv_bytes: int, name: str = "member",
                 kv: torch.Tensor | None = None, blocks: BlockManager | None = None):
        """A cache of its own (``kv_bytes``), or a worker's engine cache shared (``kv`` and its
        ``blocks``: then ``reserve`` / ``release`` must run where the engine allocates, see
        ``shared/ring/server.EngineMember``)."""
        if SEG % layout.block_size:
            raise ValueError(f"block size {layout.block_size} must divide the attention segment {SEG}")
        self.kernels, self.layout, self.name = kernels, layout, name
        if kv is None:
            num_blocks = kv_bytes // layout.block_bytes
            if num_blocks < 1:
                raise ValueError(f"a KV budget of {kv_bytes} bytes holds no block of {layout.block_bytes}")
            kv = torch.zeros((num_blocks, *layout.block_shape), dtype=KV_DTYPE)
            blocks = BlockManager(num_blocks, layout.block_size, enable_prefix_caching=False)
        self.kv, self.blocks = kv, blocks
        self.shards: dict[str, _Shard] = {}
        self._posted: dict[str, tuple] = {}    # session -> the layer's step ``post``ed, not collected

    def reserve(self, sid: str, start: int, end: int) -> None:
        """Take blocks for positions [start, end) of session ``sid``; RingCapacityError if they do not fit."""
        bs = self.layout.block_size
        if sid in self.shards or start % SEG or end <= start:
            raise ValueError(f"{self.name}: bad shard [{start}, {end}) for {sid!r}")
        need = self.layout.blocks_for(end - start)
        got = self.blocks.allocate(need)
        if got is None:
            raise RingCapacityError(
                f"{self.name}: tokens [{start}, {end}) need {need} KV blocks ({need * bs} tokens), "
                f"{self.blocks.num_free} of {self.blocks.num_blocks} are free "
                f"({self.blocks.num_blocks * self.layout.block_bytes / 2**20:.1f} MiB budget)")
        pad = [got[0]] * (start // bs)
        self.shards[sid] = _Shard(start, end, got, torch.tensor(pad + got, dtype=torch.int64))

    @torch.inference_mode()   # an engine's cache (``kv`` shared) is an inference tensor
    def load(self, sid: str, kv, first: int = 0) -> None:
        """Fill the shard's blocks from its ``first`` on with ``kv`` (bytes-like, whole blocks
        of layout v1)."""
        sh = self.shards[sid]
        if not memoryview(kv).nbytes:   # a range past the computed positions: nothing to load yet
            return
        data = torch.frombuffer(bytearray(kv), dtype=torch.uint8).view(KV_DTYPE)
        n = data.numel() * 2 // self.layout.block_bytes
        if n * self.layout.block_bytes != data.numel() * 2 or not 0 <= first <= first + n <= len(sh.blocks):
            raise ValueError(f"{self.name}: {data.numel() * 2} bytes from block {first} are not whole KV blocks "
                             f"within the shard's {len(sh.blocks)}")
        if n:
            self.kv[torch.tensor(sh.blocks[first:first + n])] = data.view(n, *self.layout.block_shape)

    def owns(self, sid: str, pos: int) -> bool:
        sh = self.shards[sid]
        return sh.start <= pos < sh.end

    def store(self, sid: str, layer: int, qkv: torch.Tensor, pos: int) -> None:
        """Write the new tokens' k and v (rows of ``qkv``, positions pos..) of ``layer``."""
        sh = self.shards[sid]
        if not (sh.start <= pos and pos + qkv.shape[0] <= sh.end):
            raise ValueError(f"{self.name}: positions {pos}+{qkv.shape[0]} outside the shard [{sh.start}, {sh.end})")
        self.kernels.store(layer, qkv, pos, self.kv, sh.table)

    def segments(self, sid: str, keys: int) -> tuple[int, int]:
        """The segments [lo, hi) of this shard holding some of the first ``keys`` keys (lo == hi: none)."""
        sh = self.shards[sid]
        lo = sh.start // SEG
        return lo, max(lo, -(-min(sh.end, keys) // SEG))

    def attend(self, sid: str, layer: int, qkv: torch.Tensor, pos: int,
               heads: tuple[int, int] | None = None) -> torch.Tensor | None:
        """Softmax states [kv heads, segments, part] of the q rows at positions pos.. over this
        shard's keys, for kv heads ``heads`` (default all) (None: it holds none of them yet)."""
        lo, hi = self.segments(sid, pos + qkv.shape[0])
        if lo == hi:
            return None
        return self.kernels.attend(layer, qkv, pos, self.kv, self.shards[sid].table, lo, hi, heads)

    def post(self, sid: str, layer: int, qkv: torch.Tensor, pos: int, store: bool) -> None:
        """A step's layer for this member (``store``: it owns the new position); computed by
        ``collect`` (a remote member starts on it here)."""
        self._posted[sid] = (layer, qkv, pos, store)

    def collect(self, sid: str) -> torch.Tensor | None:
        """The posted layer: store the new k, v if asked, then ``attend``."""
        layer, qkv, pos, store = self._posted.pop(sid)
        if store:
            self.store(sid, layer, qkv, pos)
        return self.attend(sid, layer, qkv, pos)

    def read(self, sid: str, keys: int) -> bytes:
        """The shard's blocks holding any of the first ``keys`` positions, as bytes."""
        sh = self.shards[sid]
        n = self.layout.blocks_for(max(0, min(sh.end, keys) - sh.start))
        if not n:
            return b""
        return self.kv.index_select(0, torch.tensor(sh.blocks[:n])).contiguous().view(torch.uint8).numpy().tobytes()

    def release(self, sid: str) -> None:
        self._posted.pop(sid, None)
        sh = self.shards.pop(sid, None)
        if sh is not None:
            self.blocks.release(sh.blocks)


def shard_bytes(layout: KVLayout, kv: memoryview, start: int, end: int, num_computed: int) -> memoryview:
    """The bytes of ``kv`` (the whole blocks of a session's first ``num_computed`` positions)
    that the shard of positions [start, end) loads: its blocks holding computed positions."""
    bs, bb = layout.block_size, layout.block_bytes
    return kv[start // bs * bb:(layout.blocks_for(min(end, num_computed)) if start < num_computed else start // bs) * bb]


@dataclass
class StepTimes:
    """Where a ring's decode steps spent their time (seconds, summed since the last reset)."""
    steps: int = 0
    total: float = 0.0         # whole steps
    attend: float = 0.0        # from the q|k|v rows out to the states merged: the members' store
                               # + attention (+ the fold), with the messages and the waits
    merge_ffn: float = 0.0     # the merge and the rest of each layer (the rest of total: embed,
                               # q|k|v, head)
    wait: float = 0.0          # of which blocked on a remote member's message (its first bytes)
    transfer: float = 0.0      # of which sending messages and reading them (and their tags)
    bytes_out: int = 0         # q|k|v rows (and running states) the coordinator sends the members
    bytes_back: int = 0        # segment states the coordinator receives (fold: the running state)
    bytes_ring: int = 0        # member to member: running states (and q rows passed along the ring)


@dataclass
class _Session:
    ranges: list[tuple[int, int]]
    num_computed: int          # positions whose KV the members hold
    token_ids: list[int] = field(default_factory=list)


class Ring:
    """The coordinator: the model's weights and N members; each session decodes a token a step."""

    def __init__(self, kernels: RingKernels, members: list, fold: bool = False, groups: int = 1,
                 qpass: bool = False):
        """``fold``: the members fold their segment states along the ring in shard order and the
        coordinator receives one state per kv head (else every segment's state comes back and
        the coordinator folds them). The same merges in the same order: the same bits. Remote
        members pass the state member to member over links of their own (``shared/ring/server``);
        ``groups``: head groups a layer's fold is pipelined in (each group's state passed on
        while the next is attended; 1: the whole layer); ``qpass``: the q rows go along the
        ring member to member instead of from the coordinator to each (broadcast)."""
        if not members:
            raise ValueError("a ring needs at least one member")
        if not 1 <= groups <= kernels.cfg.n_kv_heads:
            raise ValueError(f"head groups must be 1..{kernels.cfg.n_kv_heads}, got {groups}")
        self.kernels, self.members, self.fold, self.groups, self.qpass = kernels, members, fold, groups, qpass
        self.remote = [not isinstance(m, LocalMember) for m in members]   # members: RingMember
        self.sessions: dict[str, _Session] = {}
        self.times = StepTimes()

    def admit(self, sid: str, token_ids: list[int], num_computed: int, kv, max_total: int) -> list[tuple[int, int]]:
        """Scatter a prefilled session: ``kv`` holds the whole blocks of its first
        ``num_computed`` positions (layout v1, as ``Engine.export_kv``'s blob carries them);
        ``token_ids`` its tokens so far (``token_ids[num_computed]`` is computed by the next
        step); ``max_total`` the most positions it may reach. Returns the members' ranges.
        RingCapacityError (nothing kept) when a member cannot hold its range."""
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already on this ring")
        layout = self.members[0].layout
        if not 0 < num_computed < len(token_ids) <= max_total <= self.kernels.max_context:
            raise ValueError(f"need 0 < computed ({num_computed}) < tokens ({len(token_ids)}) <= max total "
                             f"({max_total}) <= context ({self.kernels.max_context})")
        mv = memoryview(kv).cast("B")
        if mv.nbytes != layout.blocks_for(num_computed) * layout.block_bytes:
            raise ValueError(f"KV of {mv.nbytes} bytes is not the {layout.blocks_for(num_computed)} blocks "
                             f"of {num_computed} positions")
        ranges = shard_ranges(max_total, len(self.members))
        done: list = []
        try:
            for m, (a, b) in zip(self.members, ranges):
                m.reserve(sid, a, b)
                done.append(m)
        except Exception:
            for m in done:
                m.release(sid)
            raise
        slices = [shard_bytes(layout, mv, a, b, num_computed) for a, b in ranges]
        if len(self.members) == 1:
            self.members[0].load(sid, slices[0])
        else:   # every member loads its range at the same time (remote ones on their own connections)
            with ThreadPoolExecutor(len(self.members), thread_name_prefix="ring-scatter") as pool:
                for f in [pool.submit(m.load, sid, kv_slice) for m, kv_slice in zip(self.members, slices)]:
                    f.result()
        if self.fold and any(self.remote):
            try:
                self._chain(sid)
            except BaseException:
                for m in self.members:
                    m.release(sid)
                raise
        self.sessions[sid] = _Session(ranges, num_computed, list(token_ids))
        return ranges

    def adopt(self, sid: str, token_ids: list[int], num_computed: int, ranges: list[tuple[int, int]]) -> None:
        """A session whose shards the members hold already, in ``ranges`` (a prefill scattered
        them and this coordinator claimed them: ``shared/ring/connector.admit_claimed``). With the
        fold the remote members are told their places in it, as ``admit`` does (on a failure the
        caller releases the session's shards)."""
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already on this ring")
        if not 0 < num_computed < len(token_ids) <= ranges[-1][1]:
            raise ValueError(f"need 0 < computed ({num_computed}) < tokens ({len(token_ids)}) <= the ring's "
                             f"length ({ranges[-1][1]})")
        if self.fold and any(self.remote):
            self._chain(sid)
        self.sessions[sid] = _Session(list(ranges), num_computed, list(token_ids))

    def _chain(self, sid: str) -> None:
        """Tell each remote member its place in the fold, the last first: a member's link to
        the next is opened with the ticket the next was told to expect."""
        tickets = [os.urandom(16).hex() for _ in self.members]   # ticket i: the link into member i
        for i in reversed(range(len(self.members))):
            if not self.remote[i]:
                continue
            prev = "none" if i == 0 else "peer" if self.remote[i - 1] else "coord"
            nxt = self.members[i + 1] if i + 1 < len(self.members) and self.remote[i + 1] else None
            self.members[i].chain(sid, i, prev, self.members[i - 1].name if i else "",
                                  tickets[i] if prev == "peer" else None,
                                  [nxt.name, nxt.host, nxt.port, tickets[i + 1]] if nxt is not None else None)

    def admit_blob(self, sid: str, blob, max_new_tokens: int) -> list[tuple[int, int]]:
        """``admit`` the session of a KV blob (``Engine.export_kv`` of a prefilled request),
        planned for ``max_new_tokens`` more tokens."""
        h, kv = KVBlobHeader.parse(blob)
        if h.layout != self.members[0].layout.to_dict():
            raise ValueError(f"KV layout {h.layout} does not match the ring's {self.members[0].layout.to_dict()}")
        total = min(len(h.token_ids) + max_new_tokens, self.kernels.max_context)
        return self.admit(sid, h.token_ids, h.num_computed, kv, total)

    @torch.inference_mode()
    def step(self, sid: str) -> torch.Tensor:
        """Compute the session's next token (``token_ids[num_computed]``); logits [1, vocab]."""
        s, k, t = self.sessions[sid], self.kernels, self.times
        pos = s.num_computed
        if pos >= len(s.token_ids):
            raise ValueError(f"session {sid!r}: no token to compute (append the sampled one first)")
        if pos >= s.ranges[-1][1]:
            raise ValueError(f"session {sid!r} reached its planned length {s.ranges[-1][1]}")
        t0 = time.perf_counter()
        chans = [m.ch for m, r in zip(self.members, self.remote) if r]
        w0, x0 = sum(c.wait_s for c in chans), sum(c.xfer_s for c in chans)
        b0 = (t.bytes_out, t.bytes_back, t.bytes_ring)
        x = k.embed(torch.tensor([s.token_ids[pos]]), pos)
        tail = next(i for i, m in enumerate(self.members) if m.owns(sid, pos))
        try:
            for layer in range(k.cfg.n_layers):
                qkv = k.qkv(layer, x, pos)
                a0 = time.perf_counter()
                if self.fold:
                    parts = self._fold_layer(sid, layer, qkv, pos, tail)
                else:
                    parts = self._parts_layer(sid, layer, qkv, pos, tail)
                a1 = time.perf_counter()
                t.attend += a1 - a0
                k.merge_ffn(layer, x, qkv, pos, parts, self.fold)
                t.merge_ffn += time.perf_counter() - a1
        except BaseException:
            if self.fold and any(self.remote):   # a fold broken mid-layer leaves messages in flight
                self.close()
            raise
        logits = k.head(x, pos)
        s.num_computed = pos + 1
        t.steps += 1
        seconds = time.perf_counter() - t0
        t.total += seconds
        t.wait += sum(c.wait_s for c in chans) - w0
        t.transfer += sum(c.xfer_s for c in chans) - x0
        if any(self.remote):   # ring traffic between processes, in the metrics like the hand-off's
            metrics.ring_step(seconds, out=t.bytes_out - b0[0], back=t.bytes_back - b0[1],
                              ring=t.bytes_ring - b0[2])
        return logits

    def _parts_layer(self, sid: str, layer: int, qkv: torch.Tensor, pos: int, tail: int) -> torch.Tensor:
        """Every segment's state, in segment order: [nkv, segments, part]."""
        t = self.times
        for m, r in zip(self.members, self.remote):   # remote members first: they attend while a local one does
            if r:
                m.post(sid, layer, qkv, pos, m is self.members[tail])
        for m, r in zip(self.members, self.remote):
            if not r:
                m.post(sid, layer, qkv, pos, m is self.members[tail])
        parts = [p for p in (m.collect(sid) for m in self.members) if p is not None]   # shard order
        t.bytes_out += qkv.numel() * 4 * len(parts)
        t.bytes_back += sum(p.numel() * 4 for p in parts)
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _fold_layer(self, sid: str, layer: int, qkv: torch.Tensor, pos: int, tail: int) -> torch.Tensor:
        """The fold along the members 0..tail (those holding keys): member i folds its segments
        into the running state member i - 1 passed on, head group by head group; remote members
        pass it to the next remote member themselves. The folded state: [nkv, 1, part]."""
        k, t, G, nkv = self.kernels, self.times, self.groups, self.kernels.cfg.n_kv_heads
        chain, remote = self.members[:tail + 1], self.remote[:tail + 1]
        meta = {"layer": layer, "pos": pos, "tail": tail, "groups": G, "qpass": self.qpass}
        q_bytes = qkv.numel() * 4
        for i, m in enumerate(chain):   # the q rows: to every remote member, or along the ring
            if remote[i]:
                if not self.qpass or i == 0 or not remote[i - 1]:
                    m.post_step(sid, meta, qkv)
                    t.bytes_out += q_bytes
                else:
                    t.bytes_ring += q_bytes
        heads = [(g * nkv // G, (g + 1) * nkv // G) for g in range(G)]
        states: list[torch.Tensor | None] = [None] * G   # each group's running state, here
        for i, m in enumerate(chain):   # the coordinator's own members, in shard order
            if remote[i]:
                if i < tail and remote[i + 1]:
                    t.bytes_ring += sum(self._state_bytes(h, qkv) for h in heads)
                continue
            if i == tail:
                m.store(sid, layer, qkv, pos)
            for g in range(G):
                parts = m.attend(sid, layer, qkv, pos, heads[g])
                if i:
                    prev = chain[i - 1].recv_state(g) if remote[i - 1] else states[g]
                    parts = torch.cat([prev, parts], dim=1)
                states[g] = k.fold(parts, pos, qkv.shape[0], heads[g])
                if i < tail and remote[i + 1]:
                    chain[i + 1].send_state(sid, g, states[g])
                    t.bytes_out += states[g].numel() * 4
                elif i < tail:   # to the next member in this process (a message between processes)
                    t.bytes_ring += states[g].numel() * 4
        if remote[tail]:
            states = [chain[tail].recv_state(g) for g in range(G)]
            t.bytes_back += sum(st.numel() * 4 for st in states)
        return torch.cat(states, dim=0) if G > 1 else states[0]

    def _state_bytes(self, heads: tuple[int, int], qkv: torch.Tensor) -> int:
        return (heads[1] - heads[0]) * self.kernels.part_floats(qkv.shape[0]) * 4

    def append(self, sid: str, token: int) -> None:
        """Add the token sampled from the last step's logits (computed by the next step)."""
        self.sessions[sid].token_ids.append(int(token))

    def generate(self, sid: str, n: int) -> tuple[list[int], list[torch.Tensor]]:
        """``n`` greedy steps: the tokens appended and each step's logits."""
        toks, logits = [], []
        for _ in range(n):
            lg = self.step(sid)
            tok = int(lg[0].argmax())
            self.append(sid, tok)
            toks.append(tok)
            logits.append(lg)
        return toks, logits

    def gather(self, sid: str) -> bytes:
        """The session's KV (every computed position, whole blocks of layout v1) from its shards."""
        n = self.sessions[sid].num_computed
        return b"".join(m.read(sid, n) for m in self.members)

    def release(self, sid: str) -> None:
        """Free the session's shards, the last member first (a member's link into the next
        then ends after the next let go of the session: no loss to report)."""
        self.sessions.pop(sid, None)
        for m in reversed(self.members):
            m.release(sid)

    def close(self) -> None:
        """Close the connections of remote members (``shared/ring/remote.RemoteMember``): a ring per session."""
        for m in self.members:
            if not isinstance(m, LocalMember):
                m.close()
