"""Continuous batching: which sequences compute how many tokens in the next step.

Each step: running sequences first, best priority first (a decode is one token, a sequence in
chunked prefill takes what the token budget leaves), then waiting sequences in queue order
(priority = SLA tier, then arrival). The budget is ``step_tokens`` while any sequence decodes
(every stream waits for the step) and ``prefill_step_tokens`` while none does and the best
prompt is not batch work: a long prompt alone computes in throughput-sized steps, a batch flood
in short ones (an interactive arrival waits for one step). A prompt that would take the whole
step leaves half of it to the short prompts of its tier queued behind it (past other long ones),
so a short prompt behind long ones waits a step or two, not their whole prefills. When the KV
blocks run out, the lowest-priority running sequence is preempted: its KV is copied to host
memory (the swap space), its blocks are freed and it goes back to the queue; on resume the
bytes are copied back, so it continues exactly where it stopped. When the swap space is full, a preempted sequence's KV is dropped
and recomputed on resume instead. Nothing is dropped. When every sequence slot is taken, a
waiting sequence of a better tier preempts the worst running one the same way (interactive
work preempts batch work on a shared worker).

Within a tier the queue is **shared fairly between API keys** (``fair``; start-time fair
queueing, one request one unit, each tier a clock of its own): a sequence that enters gets the
tag ``max(V, its owner's last tag in its tier) + 1``, where V is the tier's largest tag started
so far (admitted from the queue, or imported running: a hand-off, a migration), and the queue is
in tag order. One key's requests stay in arrival order; a key that sends one request while
another has hundreds queued gets the next free slot, not the end of the queue; a key that has
been idle starts at V, with no credit saved up and no debt kept; a key's work at one tier never
places its requests at another. With one key (or none) the order is arrival order, as without
it. The worst running sequence (the first preempted) is then, within the lowest tier, the newest
of the key furthest ahead.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from shared.engine.kv_cache import BlockManager
from shared.tier import Tier
from shared.engine.sequence import Sequence, Status

BATCH_PRIORITY = Tier.BATCH.priority
INTERACTIVE_PRIORITY = Tier.INTERACTIVE.priority
SHORT_SCAN = 64   # how far past a long prompt the scheduler looks for a short one of its tier
SHORT_TOKENS = 256  # a prompt this short (and a quarter of the long one's rest at most) shares its step


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int        # first position computed (== seq.num_computed)
    num_tokens: int   # tokens computed this step
    sample: bool      # the chunk reaches the sequence's last token: sample the next one


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, step_tokens: int,
                 kv: torch.Tensor, swap_bytes: int, shared_step_tokens: int | None = None,
                 guest_step_tokens: int | None = None, prefill_step_tokens: int | None = None,
                 fair: bool = True):
        self.blocks = blocks
        self.kv = kv                    # the engine's KV tensor (kv_cache.py layout)
        self.swap_bytes = swap_bytes    # host memory for preempted sequences' KV
        self.swap_used = 0
        self.max_num_seqs = max_num_seqs
        self.max_tokens = step_tokens
        # the budget while nothing decodes (fewer passes over the weights, larger matrix products)
        self.prefill_tokens = max(step_tokens, prefill_step_tokens or step_tokens)
        # worse tiers' prefill per step at any time: guests on a latency worker run in small slices,
        # so an interactive arrival waits at most one short step
        self.guest_step_tokens = self.prefill_tokens if guest_step_tokens is None else guest_step_tokens
        # while interactive work is in the engine, worse tiers' prefill gets at most this many
        # tokens of a step, so that the step (the interactive TTFT and TPOT) stays short
        self.shared_step_tokens = step_tokens if shared_step_tokens is None else shared_step_tokens
        self.waiting: list[Sequence] = []   # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.fair = fair                   # share each tier's queue between API keys (module doc)
        self.fair_time: dict[int, int] = {}  # priority -> V: the largest tag started at that tier
        self.fair_last: dict[tuple[int, str], int] = {}  # (priority, owner) -> the tag of its latest

    def _tag(self, seq: Sequence) -> None:
        """Give a sequence entering the engine its fair-share tag (once: a preempted one keeps it)."""
        if seq.fair_tag is not None:
            return
        if not self.fair:
            seq.fair_tag = 0
            return
        key, v = (seq.priority, seq.owner), self.fair_time.get(seq.priority, 0)
        seq.fair_tag = max(v, self.fair_last.get(key, 0)) + 1
        self.fair_last[key] = seq.fair_tag
        if len(self.fair_last) > 4096:   # owners at or below their tier's V start at V anyway
            self.fair_last = {k: t for k, t in self.fair_last.items() if t > self.fair_time.get(k[0], 0)}

    def _started(self, seq: Sequence) -> None:
        """``seq`` runs from now on (admitted, or imported running): its tier's V moves up to it."""
        if seq.fair_tag:
            self.fair_time[seq.priority] = max(self.fair_time.get(seq.priority, 0), seq.fair_tag)

    def tag_running(self, seq: Sequence) -> None:
        """Tag a sequence that runs from now on without queueing: imported (``add_running``), or
        running at another tier now (``Engine.set_priority``: its tag in that tier)."""
        self._tag(seq)
        self._started(seq)

    def add(self, seq: Sequence) -> None:
        self._tag(seq)
        seq.status = Status.WAITING
        keys = [s.sort_key() for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.sort_key()), seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence that arrives with its KV already in place (imported)."""
        self.tag_running(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished, aborted, parked or exported)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)

    def waiting_owners(self) -> dict[str, int]:
        """Owner (API key) -> its sequences in the queue."""
        out: dict[str, int] = {}
        for s in self.waiting:
            out[s.owner] = out.get(s.owner, 0) + 1
        return out

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        nb = self.blocks.blocks_needed(0, seq.num_computed)
        nbytes = nb * self.kv[0].numel() * self.kv.element_size()
        if nb and self.swap_used + nbytes <= self.swap_bytes:
            idx = torch.tensor(seq.block_table[:nb], device=self.kv.device)
            seq.swapped = self.kv.index_select(0, idx).to("cpu")
            self.swap_used += nbytes
        else:
            seq.block_hashes, seq.num_computed = [], 0
        self.blocks.release(seq.block_table)
        seq.block_table = []
        self.running.remove(seq)
        self.add(seq)
        self.num_preemptions += 1

    def _grow(self, seq: Sequence, num_tokens: int, may_preempt) -> bool:
        """Give ``seq`` blocks for ``num_tokens`` tokens, preempting victims ``may_preempt`` allows."""
        need = self.blocks.blocks_needed(len(seq.block_table), num_tokens)
        while True:
            got = self.blocks.allocate(need)
            if got is not None:
                seq.block_table.extend(got)
                return True
            victims = [s for s in self.running if s is not seq and may_preempt(s)]
            if not victims:
                return False
            self._preempt(max(victims, key=Sequence.sort_key))

    def decodes_fit(self) -> bool:
        """Would the next schedule run every running sequence's next token, and only that, without
        preempting anything? Every running sequence decodes; none waiting that the schedule would
        take up (room under the sequence cap: admitted; a better tier at the cap: a preemption);
        and a free block for each sequence whose next token starts one."""
        if self.waiting and (len(self.running) < self.max_num_seqs
                             or self.waiting[0].priority < max(s.priority for s in self.running)):
            return False
        if any(s.num_tokens - s.num_computed != 1 for s in self.running):
            return False
        bs = self.blocks.block_size
        return sum(s.num_computed + 1 > len(s.block_table) * bs for s in self.running) <= self.blocks.num_free

    def schedule(self) -> list[ScheduledChunk]:
        """This step's chunks: every running decode (one token each, best tier first), then
        prefill chunks of running and waiting sequences in tier order, so a better tier's
        prompt is never held back behind a worse tier's long prefill; while interactive work is
        in the engine, worse tiers' prefill shares at most ``shared_step_tokens`` of the step (and
        ``guest_step_tokens`` at any time)."""
        out: list[ScheduledChunk] = []
        # Every sequence slot taken and a better tier waiting: the worst running sequence makes
        # room (its KV goes to host memory; it resumes where it stopped).
        while (self.waiting and len(self.running) >= self.max_num_seqs
               and self.waiting[0].priority < max(s.priority for s in self.running)):
            self._preempt(max(self.running, key=Sequence.sort_key))
        running = sorted(self.running, key=Sequence.sort_key)
        decodes = [s for s in running if s.num_tokens - s.num_computed == 1]
        prefills = [s for s in running if s.num_tokens - s.num_computed > 1]
        queue = sorted(prefills + self.waiting, key=Sequence.sort_key)
        # no stream waits on a step without decodes: a better-than-batch prompt then takes a long
        # step (batch prompts keep short ones: an interactive arrival waits one short step at most)
        budget = self.prefill_tokens if not decodes and queue and queue[0].priority < BATCH_PRIORITY \
            else self.max_tokens
        for seq in decodes:
            if budget == 0:
                break
            budget -= self._run(seq, budget, out)
        admitting = True  # waiting sequences are admitted in queue order until one does not fit
        interactive = any(s.priority == INTERACTIVE_PRIORITY for s in running + queue)
        worse_left = min(self.shared_step_tokens if interactive else budget, self.guest_step_tokens)
        short: list[Sequence] = []  # short prompts moved up to share a long one's step
        for i, seq in enumerate(queue):
            allowed = budget if seq.priority == INTERACTIVE_PRIORITY else min(budget, worse_left)
            left = seq.num_tokens - seq.num_computed
            if not short and left > allowed:
                short = self._short_after(queue[i + 1:], seq.priority, max(allowed // 2, min(SHORT_TOKENS, left // 4)))
                if short:
                    # a prompt that alone fills the step leaves half of it to the short prompts of its
                    # tier queued after it, past other long ones: those are not held behind whole long
                    # prefills (52 s behind 8,000 tokens on 2 cores; 7 s behind three 2,000-token ring
                    # prompts), and the long one goes on at half the step or more (long prompts keep
                    # their order among themselves: sharing would only finish the first later)
                    moved = set(map(id, short))
                    queue[i + 1:] = short + [q for q in queue[i + 1:] if id(q) not in moved]
                    allowed -= allowed // 2
            if allowed == 0:
                if budget == 0:
                    break
                admitting = admitting and seq.status is not Status.WAITING
                continue
            if seq.status is Status.RUNNING:
                took = self._run(seq, allowed, out)
            elif admitting and seq.status is Status.WAITING and seq in self.waiting:
                if len(self.running) >= self.max_num_seqs or seq is not self.waiting[0] and seq not in short:
                    admitting = False
                    continue
                took = self._admit(seq, allowed, out)
                admitting = took > 0
            else:
                continue
            budget -= took
            if seq.priority != INTERACTIVE_PRIORITY:
                worse_left -= took
        # a better sequence's blocks may have come from a worse one scheduled earlier in this step
        # (decodes go first, whatever their tier): preempted, it has no blocks now and sits out
        # this step (its KV swapped out, it resumes where it stopped)
        return [c for c in out if c.seq.status is Status.RUNNING]

    def _short_after(self, rest: list[Sequence], tier: int, short: int) -> list[Sequence]:
        """The sequences of ``tier`` at the head of ``rest`` (the queue after a long prompt, in tier
        order) with at most ``short`` prompt tokens left — half the step, or up to ``SHORT_TOKENS``
        where the long one has four times as many left: a 40-token chat behind 2,000-token prompts
        in 64-token steps takes two steps at half — that may compute in this step: in chunked
        prefill already, or waiting while sequence slots are free. At most ``SHORT_SCAN`` are
        looked at: a step's cost stays bounded."""
        found, slots = [], self.max_num_seqs - len(self.running)
        for seq in rest[:SHORT_SCAN]:
            if seq.priority != tier:
                break
            if seq.num_tokens - seq.num_computed <= short and (seq.status is Status.RUNNING or slots > 0):
                found.append(seq)
                slots -= seq.status is not Status.RUNNING
        return found

    def _run(self, seq: Sequence, budget: int, out: list[ScheduledChunk]) -> int:
        """Schedule a running sequence's next chunk; the tokens it takes (0: it was preempted)."""
        if seq.status is not Status.RUNNING:
            return 0  # preempted earlier in this step
        n = min(seq.num_tokens - seq.num_computed, budget)
        end = seq.num_computed + n
        if end > len(seq.block_table) * self.blocks.block_size:   # (a decode: one step in a block's 16)
            worse = lambda s, me=seq: s.sort_key() > me.sort_key()  # noqa: E731
            if not self._grow(seq, end, worse):
                self._preempt(seq)  # nothing worse to evict: this one waits
                return 0
        out.append(ScheduledChunk(seq, seq.num_computed, n, end == seq.num_tokens))
        return n

    def _admit(self, seq: Sequence, budget: int, out: list[ScheduledChunk]) -> int:
        """Start (or resume) the head of the queue; the tokens it takes (0: it does not fit yet)."""
        extra = 0
        if seq.swapped is not None:
            if not self._swap_in(seq):
                return 0
        elif not seq.block_table:  # fresh or recomputing: reuse cached prefix blocks
            cached = self.blocks.match_prefix(seq.token_ids, seq.num_tokens - 1, seq.salt)
            self.blocks.acquire_cached(cached)
            seq.block_table = list(cached)
            seq.block_hashes = [self.blocks.hash_of[b] for b in cached]
            seq.num_computed = len(cached) * self.blocks.block_size
            partial = seq.partial_kv   # the pool's partial block right after the cached ones
            extra = partial[1] if partial is not None and partial[0] == seq.num_computed else 0
            if seq.num_cached_tokens == 0 and (seq.num_output_tokens == 0 or seq.resumed):
                # usage's cached_tokens: prompt tokens whose KV was reused (a resumed request's
                # reused output tokens are not prompt; it reported 0 however much it reused)
                seq.num_cached_tokens = min(seq.num_computed + extra, seq.num_prompt_tokens)
            if seq.resumed and seq.resume_reused is None:
                seq.resume_reused = seq.num_computed + extra
        n = min(seq.num_tokens - seq.num_computed - extra, budget)
        lower = lambda s, me=seq: s.priority > me.priority  # noqa: E731
        if not self._grow(seq, seq.num_computed + extra + n, lower):
            self.blocks.release(seq.block_table)  # keep queue order: wait for blocks
            seq.block_table, seq.block_hashes, seq.num_computed = [], [], 0
            return 0
        if extra:  # its slots in the sequence's next block (not full: never shared, never hashed yet)
            _, _, block = seq.partial_kv
            self.kv[seq.block_table[seq.num_computed // self.blocks.block_size], :, :, :extra] = block[:, :, :extra]
            seq.num_computed += extra
        seq.partial_kv = None
        self.waiting.remove(seq)
        self._started(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        out.append(ScheduledChunk(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
        return n

    def _swap_in(self, seq: Sequence) -> bool:
        """Copy a preempted sequence's KV back into fresh blocks; False if they do not fit."""
        nb = seq.swapped.shape[0]
        got = self.blocks.allocate(self.blocks.blocks_needed(0, seq.num_tokens))  # + room to go on
        if got is None:
            return False
        self.kv[torch.tensor(got[:nb], device=self.kv.device)] = seq.swapped.to(self.kv.device)
        self.swap_used -= seq.swapped.numel() * seq.swapped.element_size()
        seq.swapped = None
        seq.block_table = got
        for b, h in zip(got, seq.block_hashes):
            self.blocks.adopt(b, h)
        return True

    def drop(self, seq: Sequence) -> None:
        """Forget a sequence that leaves the engine: queues, blocks and swapped KV. A batch
        sequence's cached blocks are the first to be reused; interactive ones stay hot longest."""
        self.remove(seq)
        self.blocks.release(seq.block_table, evict_first=seq.priority >= BATCH_PRIORITY)
        seq.block_table, seq.block_hashes = [], []
        if seq.swapped is not None:
            self.swap_used -= seq.swapped.numel() * seq.swapped.element_size()
            seq.swapped = None

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """After the forward pass: advance computed counts and hash blocks that became full."""
        bs = self.blocks.block_size
        for c in chunks:
            seq = c.seq
            seq.num_computed = c.start + c.num_tokens
            while len(seq.block_hashes) < seq.num_computed // bs:
                i = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else seq.salt or None
                seq.block_hashes.append(self.blocks.register_full(
                    seq.block_table[i], parent, seq.token_ids[i * bs:(i + 1) * bs]))
