"""The engine's KV in and out: KV that leaves an engine or enters it from elsewhere.

``Engine`` takes these methods from ``KVHandoff`` (engine.py keeps the step loop):
- the KV pool's side: ``watch_chunks`` (which pool chunks the prefix cache gains and loses),
  the finished-request write-back (``finished_kv_hook``), ``read_blocks``, ``load_prefix``
  (KV computed elsewhere into the prefix cache) and ``add``'s ``prefix``;
- the hand-off and migration: ``export_kv`` / ``settle_export`` serialise a sequence as a KV
  blob (``KVBlobHeader``), ``import_kv`` continues it on any engine with the same model.

The methods read the engine's state (``kv``, ``layout``, ``blocks``, ``seqs``, ``scheduler``,
``rings``, ``chunk_events``) and run on the engine's thread like the rest of it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kvpool.keys import tenant_salt
from shared.engine import retention
from shared.engine.kv_cache import KV_DTYPE, ChunkEvents, KVBlobHeader, block_hash
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence, Status

log = logging.getLogger("tandem.engine")


AT_CAP = ("queue", "refuse", "run")   # what ``import_kv`` does with every sequence slot taken


class EngineFull(RuntimeError):
    """The KV cache cannot take this sequence now (retry later or elsewhere)."""


class KVHandoff:
    """KV in and out of an ``Engine`` (the module docstring); a mixin of ``Engine`` only."""

    def watch_chunks(self, seed: bytes, chunk_tokens: int, hook: Callable[[list[str], list[str]], None]) -> None:
        """Report which KV pool chunks (scope ``seed``, ``chunk_tokens`` tokens) the prefix cache
        gains and loses: ``hook(stored, evicted)`` after a step that changed any. No-op when
        prefix caching is off."""
        if self.blocks.prefix_caching:
            self.chunk_events = ChunkEvents(self.blocks, seed, chunk_tokens)
            self.chunk_hook = hook

    def _report_chunks(self) -> None:
        if self.chunk_events is None or not self.chunk_events.changes:
            return
        stored, evicted = self.chunk_events.take()
        try:
            self.chunk_hook(stored, evicted)
        except Exception:  # best effort, like finished_kv_hook
            log.exception("chunk-event hook failed")

    def _report_finished_kv(self, seq: Sequence) -> None:
        """The finished sequence's KV to ``finished_kv_hook``: its first ``finished_kv_align``-multiple
        computed tokens, less the whole ``finished_kv_skip`` units of the prefix it reused (those
        were cached when it came: in the pool, whose write-back this is) or that a hand-off's
        sender wrote back (``pooled_tokens``). This runs on the engine's
        thread between two steps: an 8K context's KV is 189 MB of the bundled model, ~75 ms a copy
        on a 2-vCPU VM, which every other sequence here waits for — an agent's next turn now copies
        what it added, not its whole context again."""
        n = seq.num_computed // self.finished_kv_align * self.finished_kv_align
        if n == 0:
            return
        skip, bs = self.finished_kv_skip, self.layout.block_size
        try:  # the partial last block too: a prompt's tail entry ends at its last token but one
            start = min(max(seq.num_cached_tokens, seq.pooled_tokens), n) // skip * skip // bs * bs if skip else 0
            kv = self.read_blocks(seq.block_table[start // bs:self.layout.blocks_for(n)])
            self.finished_kv_hook(seq.request_id, seq.token_ids[:n], kv, seq.tenant, seq.num_prompt_tokens,
                                  seq.retention, start)
        except Exception:  # the hook is best effort; the request finishes regardless
            log.exception("finished-KV hook failed for %s", seq.request_id)

    def read_blocks(self, blocks: list[int]) -> memoryview:
        """The KV of ``blocks``, in order, as a bytes-like view (layout v1) of one copy."""
        kv = self.kv.index_select(0, torch.tensor(blocks, device=self.device)).cpu()
        return memoryview(kv.contiguous().view(torch.uint8).numpy()).cast("B")

    @torch.inference_mode()
    def load_prefix(self, token_ids: list[int], kv, tenant: str = "") -> int:
        """Put KV computed elsewhere (the KV pool) into the prefix cache: ``kv`` holds the whole
        blocks of ``token_ids`` (a multiple of the block size), layout v1. A request of ``tenant``
        starting with these tokens then reuses them like any cached block (``num_cached_tokens``).
        Blocks already cached here are skipped. Returns the tokens loaded (0 when no blocks are
        free or prefix caching is off: the request then computes them). Raises ValueError when sizes do not match."""
        bs, n = self.layout.block_size, len(token_ids)
        if n % bs or memoryview(kv).nbytes != n // bs * self.layout.block_bytes:
            raise ValueError(f"prefix KV of {memoryview(kv).nbytes} bytes does not hold {n} tokens "
                             f"in whole blocks of {self.layout.block_bytes} bytes")
        hashes, parent = [], tenant_salt(tenant) or None
        for i in range(n // bs):
            parent = block_hash(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
        missing = [i for i, h in enumerate(hashes) if h not in self.blocks.block_of]
        got = self.blocks.allocate(len(missing)) if missing and self.blocks.prefix_caching else None
        if got is None:
            return 0
        t0 = time.perf_counter()
        data = torch.frombuffer(bytearray(kv) if memoryview(kv).readonly else kv, dtype=torch.uint8)
        data = data.view(KV_DTYPE).view(n // bs, *self.layout.block_shape)
        if len(missing) < n // bs:  # some blocks cached here already: only the others (else no gather copy)
            data = data[torch.tensor(missing)]
        self.kv.index_copy_(0, torch.tensor(got, device=self.device), data.to(self.device))
        log.info("prefix of %d tokens loaded into %d KV blocks in %.1f ms", n, len(got),
                 (time.perf_counter() - t0) * 1e3)
        for b, i in zip(got, missing):
            self.blocks.adopt(b, hashes[i])
        self.blocks.release(got)  # free but hashed: found by the next match_prefix
        if self.chunk_events is not None:
            self.chunk_events.note(token_ids, hashes, tenant=tenant)
        return len(missing) * bs

    def _take_prefix(self, seq: Sequence, token_ids: list[int], kv) -> None:
        """``add``'s ``prefix``: whole blocks into the prefix cache, the partial block to ``seq``."""
        bs, bb, n = self.layout.block_size, self.layout.block_bytes, len(token_ids)
        mv = memoryview(kv).cast("B")
        if mv.nbytes != self.layout.blocks_for(n) * bb or n >= seq.num_tokens or seq.token_ids[:n] != token_ids:
            raise ValueError(f"prefix KV of {mv.nbytes} bytes for {n} tokens does not fit a prompt of "
                             f"{seq.num_tokens} tokens in blocks of {bb} bytes")
        full = n // bs * bs
        self.load_prefix(token_ids[:full], mv[:full // bs * bb], tenant=seq.tenant)
        if n > full and self.blocks.prefix_caching:  # a copy of one block: the caller's buffer may go
            block = torch.frombuffer(bytearray(mv[full // bs * bb:]), dtype=torch.uint8).view(KV_DTYPE)
            seq.partial_kv = (full, n - full, block.view(self.layout.block_shape))

    # ---- KV hand-off ------------------------------------------------------------------
    @torch.inference_mode()
    def export_kv(self, request_id: str, keep: bool = False, written_back: bool = False) -> bytes:
        """Serialise a parked (or decoding) sequence — KV, tokens, sampler and text state — as a
        KV blob (``KVBlobHeader``) and remove it from this engine. ``import_kv`` on any engine with
        the same model continues it. ``keep`` (a migration that may fail): only a decoding
        sequence; it stays here, parked with its KV, until ``settle_export`` drops it or puts it
        back in the batch. A ring session's KV is gathered from its members (the bytes of a
        migration: its promotion to a single worker). ``written_back``: the caller writes this
        KV's whole chunks back to the pool (a prefill's hand-off), so the receiver's write-back
        leaves them out (``KVBlobHeader.pooled``)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise KeyError(f"no request {request_id!r} in this engine")
        ring = self.rings.get(request_id)
        ok = (Status.RUNNING,) if keep else (Status.PARKED, Status.RUNNING)
        # between steps: the prompt computed, at least the last token not (the grammar's forced
        # tokens may wait to be computed as one chunk)
        if seq.status not in ok or not seq.num_prompt_tokens <= seq.num_computed < seq.num_tokens:
            raise ValueError(f"request {request_id!r} is not between decode steps (status {seq.status.value})")
        nb = self.layout.blocks_for(seq.num_computed)
        header = KVBlobHeader(
            layout=self.layout.to_dict(), model=self.model_identity, request_id=request_id,
            token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
            num_computed=seq.num_computed, num_cached_tokens=seq.num_cached_tokens,
            params=seq.params.to_dict(), priority=seq.priority, kv_blocks=nb,
            detok=[seq.prefix_offset, seq.read_offset, seq.output_text, seq.emitted_chars], tenant=seq.tenant,
            session=seq.session, retention=seq.retention,
            pooled=seq.num_computed if written_back else max(seq.num_cached_tokens, seq.pooled_tokens))
        blob = header.pack(ring[0].gather(ring[1]) if ring else self.read_blocks(seq.block_table[:nb]))
        if keep:
            self.scheduler.remove(seq)
            seq.status = Status.PARKED   # a ring session's steps pause too (``_ring_steps``)
        else:
            self.seqs.pop(request_id)
            self._release(seq)
        return blob

    def settle_export(self, request_id: str, moved: bool) -> bool:
        """End an ``export_kv(keep=True)``: ``moved`` drops the sequence (no output), else it
        decodes on here. False when it is gone (aborted meanwhile)."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not Status.PARKED:
            return False
        if moved:
            self.seqs.pop(request_id)
            self._release(seq)
        elif request_id in self.rings:
            seq.status = Status.RUNNING
        else:
            self.scheduler.add_running(seq)
        return True

    def _imported(self, request_id: str, h: KVBlobHeader, priority: int | None) -> Sequence:
        """The sequence an exported blob's header describes (tokens, sampler and text state)."""
        if h.layout != self.layout.to_dict():
            raise ValueError(f"KV layout {h.layout} does not match this engine's {self.layout.to_dict()}")
        if h.model != self.model_identity:
            raise ValueError("KV was computed by a different model (identity mismatch)")
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        seq = Sequence(request_id, h.prompt_token_ids, SamplingParams.from_dict(h.params).validate(),
                       h.priority if priority is None else priority, tenant=h.tenant)
        seq.token_ids = list(h.token_ids)
        seq.prefix_offset, seq.read_offset, seq.output_text, seq.emitted_chars = h.detok
        seq.num_cached_tokens = h.num_cached_tokens
        if not isinstance(h.pooled, int) or h.pooled < 0:   # a peer's claim: it only ever narrows a write-back
            raise ValueError(f"bad KV blob header: pooled {h.pooled!r}")
        seq.pooled_tokens = h.pooled
        seq.session, seq.retention = h.session, h.retention
        retention.adopt(self.residency, seq)
        self._attach_guide(seq)  # the grammar state: the guide (in params) replayed over the output
        return seq

    def _queued(self, seq: Sequence, h: KVBlobHeader, kv_bytes) -> bool:
        """Put an imported sequence in the queue, its KV in host memory (``Scheduler._swap_in``
        takes it into blocks when it is admitted); False when the swap budget cannot hold it."""
        nb, sched = h.kv_blocks, self.scheduler
        nbytes = nb * self.kv[0].numel() * self.kv.element_size()
        if not nb or sched.swap_used + nbytes > sched.swap_bytes:
            return False
        seq.swapped = torch.frombuffer(bytearray(kv_bytes), dtype=torch.uint8).view(KV_DTYPE).view(
            nb, *self.layout.block_shape)
        sched.swap_used += nbytes
        seq.num_computed, parent = h.num_computed, seq.salt or None
        bs = self.layout.block_size
        for i in range(seq.num_computed // bs):
            parent = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(parent)
        self.seqs[seq.request_id] = seq
        sched.add(seq)
        return True

    @torch.inference_mode()
    def import_kv(self, request_id: str, blob: bytes | memoryview, priority: int | None = None,
                  at_cap: str = "queue") -> None:
        """Take over a sequence exported by ``export_kv`` and continue decoding it here. With
        every sequence slot taken, ``at_cap`` says what it does: ``queue`` (a hand-off from
        prefill, nowhere else to run) waits its turn in the queue of its tier with its KV in host
        memory, as a preempted sequence's (``_queued``; two router copies each placing a burst ran
        7 sequences on a worker of 4); ``refuse`` (a live move, which its source then keeps) raises
        EngineFull; ``run`` (a stopping worker's evacuation: a slower stream beats one paused or
        cut) runs past the cap."""
        if at_cap not in AT_CAP:
            raise ValueError(f"at_cap {at_cap!r}: one of {', '.join(AT_CAP)}")
        full = len(self.scheduler.running) >= self.scheduler.max_num_seqs and at_cap != "run"
        if full and at_cap == "refuse":
            raise EngineFull(f"every sequence slot is taken ({len(self.scheduler.running)} running)")
        h, kv_bytes = KVBlobHeader.parse(blob)
        tokens = h.token_ids
        if len(tokens) > self.max_context:
            raise ValueError(f"sequence of {len(tokens)} tokens exceeds this engine's context {self.max_context}")
        seq = self._imported(request_id, h, priority)
        nb = h.kv_blocks
        if full and self._queued(seq, h, kv_bytes):
            return
        got = self.blocks.allocate(nb)
        if got is None:
            raise EngineFull(f"needs {nb} KV blocks, {self.blocks.num_free} free")
        data = torch.frombuffer(bytearray(kv_bytes), dtype=torch.uint8).view(KV_DTYPE)
        self.kv[torch.tensor(got, device=self.device)] = data.view(nb, *self.layout.block_shape).to(self.device)
        seq.block_table, seq.num_computed = got, h.num_computed
        bs = self.layout.block_size
        parent = seq.salt or None
        for i in range(seq.num_computed // bs):
            parent = self.blocks.register_full(got[i], parent, tokens[i * bs:(i + 1) * bs])
            seq.block_hashes.append(parent)
        self.seqs[request_id] = seq
        self.scheduler.add_running(seq)
