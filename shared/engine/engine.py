"""The engine: add / step / abort, plus KV export and import for hand-off between engines.

``step()`` is schedule → run → sample → postprocess. Everything a worker service needs
(prefill-only requests that park their KV, export to bytes, import and continue) is on
``Engine``; the KV that leaves or enters it (the pool's write-back and prefix loads, export and
import) is written in handoff.py. ``async_engine.py`` wraps it for asyncio.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from shared.engine import grammar, retention, sampler
from kvpool.keys import tenant_owner, tenant_salt
from shared.engine.kv_cache import KV_DTYPE, BlockManager, ChunkEvents, KVBlobHeader, KVLayout
from shared.engine.handoff import EngineFull, KVHandoff  # noqa: F401 (EngineFull: re-exported)
from shared.engine.loader import LoadedModel, release_freed_memory
from shared.engine import weight_cache
from shared.engine.model import AttnChunk, StepContext, Transformer, runtime_weights
from shared.engine.sampling import RequestOutput, SamplingParams, TokenLogprob, merge_outputs
from shared.engine.scheduler import ScheduledChunk, Scheduler
from shared.engine.sequence import Sequence, Status
from shared.engine.stops import StopMatcher
from shared.engine.tokenizer import decode_step
from shared.settings import KV_BLOCK_TOKENS
from shared.tier import fair_share

log = logging.getLogger("tandem.engine")

@dataclass
class EngineConfig:
    device: str = "cpu"                 # "cpu" | "cuda" | "cuda:N"
    threads: int | None = None          # torch / kernel threads (None: leave as is)
    block_size: int = KV_BLOCK_TOKENS   # tokens per KV block
    kv_cache_bytes: int = 256 << 20     # KV budget; ignored when num_kv_blocks is set
    num_kv_blocks: int | None = None    # exact number of KV blocks (tests use tiny budgets)
    max_num_seqs: int = 64              # running sequences at most
    step_tokens: int = 512   # tokens per step (prefill chunk budget)
    prefill_step_tokens: int | None = None  # a step's budget while no sequence decodes (None or less: step_tokens)
    max_context: int | None = None      # cap below the model's context length
    enable_prefix_caching: bool = True
    swap_bytes: int = 256 << 20         # host memory for preempted sequences' KV (0: recompute)
    max_waiting: int = 256              # queued requests at most; more: EngineFull (the caller gets "overloaded")
    shared_step_tokens: int = 64   # prefill tokens of worse tiers per step while interactive work runs
    guest_step_tokens: int | None = None  # prefill tokens of worse tiers per step, always (None: no cap)
    weight_cache_dir: str | None = None  # from_path: converted weights cached here (None: weight_cache.default_dir(); "": off)
    load_threads: int | None = None     # from_path: threads converting a model on a cache miss (None: weight_cache.LOAD_THREADS)
    gpu_step: str = "graphs"            # on CUDA: graphs | fused | ops (kernels/gpu_step.py; TANDEM_GPU_STEP)
    session_retention_s: float = 0.0    # sessions' KV resident between turns this long idle (retention.py; 0: off)
    fair_tenants: bool = True           # share each tier's queue between API keys (scheduler.py; TANDEM_FAIR_TENANTS)

    def validate(self) -> "EngineConfig":
        if self.block_size < 1 or self.max_num_seqs < 1 or self.step_tokens < 1:
            raise ValueError("block_size, max_num_seqs and step_tokens must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.step_tokens < self.max_num_seqs:
            raise ValueError("step_tokens must be >= max_num_seqs (each decode needs a token)")
        if self.session_retention_s < 0:
            raise ValueError(f"session_retention_s must be >= 0, got {self.session_retention_s}")
        if self.gpu_step not in ("graphs", "fused", "ops"):
            raise ValueError(f"gpu_step must be graphs, fused or ops, got {self.gpu_step!r}")
        return self


def resolve_device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:   # torch's own message lists its 20 device types
        raise ValueError(f"unsupported device {name!r} (cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r} (cpu or cuda)")
    return dev


def _gpu_step(model: Transformer, kv: torch.Tensor, blocks: BlockManager, config: EngineConfig, max_context: int):
    """The fused GPU step (kernels/gpu_step.py) where it runs: the decode graphs, or None."""
    try:
        from kernels import gpu_step
    except ImportError:
        return None
    return gpu_step.attach(model, kv, blocks, config.gpu_step, max_context, config.max_num_seqs, config.block_size)


def _get_ops(device: torch.device):
    try:
        from kernels.dispatch import get_ops
    except ImportError:  # fast kernels not built into this tree: the reference is always there
        from kernels import q4_0
        return q4_0
    return get_ops(device)


# a sequence's next token while a step launched ahead still computes it (Engine._feed): never
# seen outside ``Engine.step``
PLACEHOLDER = -1


class Engine(KVHandoff):
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None, consume: bool = False):
        """``consume``: the engine takes the weights out of ``model`` (see ``from_path``)."""
        self.config = config = (config or EngineConfig()).validate()
        self.device = resolve_device(config.device)
        ops = _get_ops(self.device)
        if hasattr(ops, "set_num_threads"):
            # The CPU kernels run their own OpenMP team for the matmuls (nearly all the work);
            # torch's intra-op threads would compete with it for the same cores (measured: a
            # batch-1 decode step 12.7 ms with torch on 1 thread, 228 ms with torch on 2).
            ops.set_num_threads(config.threads or torch.get_num_threads())
            torch.set_num_threads(1)
        elif config.threads:
            torch.set_num_threads(config.threads)
        cfg = model.config
        self.model_config = cfg
        self.model_identity = model.identity
        self.tokenizer = model.tokenizer
        self.max_context = min(config.max_context or cfg.max_context, cfg.max_context)
        self.layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, config.block_size)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // self.layout.block_bytes)
        if num_blocks * config.block_size < self.max_context:
            # one sequence can never outgrow the whole cache: it would preempt itself and recompute
            # forever. It ends with finish_reason "length" there, and the worker advertises this
            # context, so the router sends it no prompt that cannot fit.
            log.warning("the KV cache holds %d tokens, less than the context of %d: the context is capped "
                        "there (more KV lifts it: %s)", num_blocks * config.block_size, self.max_context,
                        "a larger TANDEM_KV_BLOCKS" if config.num_kv_blocks else "a larger TANDEM_KV_BUDGET_MB")
            self.max_context = num_blocks * config.block_size
        layout = weight_cache.layout_of(ops)
        if model.runtime is not None and model.runtime != layout:
            raise ValueError(f"weights prepared for the {model.runtime!r} layout; the {self.device} kernels "
                             f"run {layout!r}")
        with torch.inference_mode():
            weights = model.weights if model.runtime is not None else \
                runtime_weights(cfg, model.weights, getattr(ops, "prepare", None), consume)
            self.model = Transformer(cfg, weights, self.device, ops)
            del weights
            self.kv = torch.zeros((num_blocks, *self.layout.block_shape), dtype=KV_DTYPE, device=self.device)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.graphs = _gpu_step(self.model, self.kv, self.blocks, config, self.max_context)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.step_tokens,
                                   self.kv, config.swap_bytes, config.shared_step_tokens,
                                   config.guest_step_tokens, config.prefill_step_tokens, config.fair_tenants)
        self.seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # outputs not tied to a forward step (aborts)
        self._ahead: tuple | None = None  # a decode step launched ahead, its tokens not read yet (step)
        # ring sessions this engine coordinates (docs/strategies.md): request id -> (its Ring, the
        # session id there); their KV is on the ring's members, a step each runs after the batch
        self.rings: dict[str, tuple] = {}
        self._failed: list[tuple[str, Exception]] = []  # ring requests that failed (take_failed)
        # Called (on the engine's thread) with (request_id, token_ids, kv, tenant, prompt tokens,
        # retention, start) when a request finishes, for its first ``finished_kv_align``-multiple
        # computed tokens (the KV pool's write-back of a finished session); ``kv`` holds the tokens
        # from ``start``: the whole ``finished_kv_skip`` units (0: none) of the prefix it reused are
        # left out (``_report_finished_kv``). None: not called.
        self.finished_kv_hook: Callable[[str, list[int], memoryview, str, int, str, int], None] | None = None
        self.finished_kv_skip = 0
        # sessions' KV resident between turns (retention.py); an evicted one's (token ids, KV, tenant,
        # retention, session) go to ``spill_hook`` (the pool's write-back), on the engine's thread
        self.residency = retention.attach(self, config.session_retention_s)
        self.spill_hook: Callable[[list[int], memoryview, str, str, str], None] | None = None
        self.finished_kv_align = config.block_size
        # Chunk events (``watch_chunks``): called on the engine's thread with (stored, evicted)
        # pool chunk keys, net, at most once per step. None: not tracked.
        self.chunk_events: ChunkEvents | None = None
        self.chunk_hook: Callable[[list[str], list[str]], None] | None = None
        self.eos_ids = set(self.tokenizer.eos_token_ids)
        self._grammar: grammar.GrammarCompiler | None = None  # built with the first guided request
        log.info("engine ready: %s on %s, %d KV blocks of %d tokens (%.1f MiB), context %d",
                 cfg.name, self.device, num_blocks, config.block_size,
                 num_blocks * self.layout.block_bytes / 2**20, self.max_context)

    @classmethod
    def from_path(cls, path: str | None = None, config: EngineConfig | None = None) -> "Engine":
        """Load ``path`` (None: the bundled model) through the weight cache (``weight_cache.py``:
        a map of the converted weights every engine on the node shares; the first load converts
        them, with ``config.load_threads`` threads). With the cache off the engine converts and
        owns the only copy: the loader's separate q/k/v and gate/up tensors are dropped once
        fused, and their heap pages given back to the OS."""
        config = (config or EngineConfig()).validate()
        ops = _get_ops(resolve_device(config.device))
        model = weight_cache.load(path, ops, config.weight_cache_dir, config.load_threads)
        engine = cls(model, config, consume=True)
        release_freed_memory()
        return engine

    # ---- requests -------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 1, prefill_only: bool = False, resume_token_ids: list[int] | None = None,
            emitted_chars: int = 0, tenant: str = "", prefix: tuple[list[int], object] | None = None) -> None:
        """Queue a request. Raises ValueError for bad input (nothing is queued then). It shares
        cached KV blocks only with requests of the same ``tenant`` ("" = the public tenant).

        ``prefix``: (token ids, KV) computed elsewhere (the KV pool) for the start of the prompt:
        its whole blocks go into the prefix cache (``load_prefix``); a last partial block is the
        request's own — it starts after those tokens (a prompt sent again computes its last token
        only). The KV holds ``blocks_for(len(token ids))`` blocks, layout v1.

        ``resume_token_ids``: continue a request that ran elsewhere (its worker was lost): the
        output tokens its client has received, ``emitted_chars`` characters of their text. They
        are computed like prompt tokens (cached blocks reused), and the next token is drawn as
        output number ``len(resume_token_ids)`` of the request's seed — what the lost worker would
        have drawn. Its first output says how many tokens were reused and recomputed."""
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        full = len(self.scheduler.waiting) >= self.config.max_waiting   # (owners counted only then)
        if full and not fair_share(len(self.scheduler.waiting), self.config.max_waiting, tenant_owner(tenant),
                                   self.scheduler.waiting_owners()):
            raise EngineFull(f"{len(self.scheduler.waiting)} requests already wait in this engine "
                             f"(TANDEM_MAX_WAITING={self.config.max_waiting})")
        params.validate()
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.max_context:
            raise ValueError(f"prompt of {n} tokens does not fit the context of {self.max_context} tokens "
                             "(one position is needed for the first generated token)")
        if self.layout.blocks_for(n + 1) > self.blocks.num_blocks:
            raise ValueError(f"prompt of {n} tokens needs {self.layout.blocks_for(n + 1)} KV blocks; "
                             f"this engine has {self.blocks.num_blocks}")
        seq = Sequence(request_id, prompt_token_ids, params, priority, prefill_only, tenant)
        retention.adopt(self.residency, seq)
        if resume_token_ids:
            self._resume(seq, resume_token_ids, emitted_chars)
        if prefix is not None:
            self._take_prefix(seq, *prefix)
        self._attach_guide(seq)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def _resume(self, seq: Sequence, outputs: list[int], emitted_chars: int) -> None:
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in outputs):
            raise ValueError(f"resumed output token ids must be in [0, {vocab})")
        if seq.num_tokens + len(outputs) >= self.max_context:
            raise ValueError(f"{seq.num_tokens} prompt + {len(outputs)} output tokens leave no room in "
                             f"the context of {self.max_context} tokens")
        if len(outputs) >= seq.params.max_tokens:
            raise ValueError(f"{len(outputs)} output tokens already reach max_tokens={seq.params.max_tokens}")
        for tok in outputs:  # the text state exactly as the first worker built it, token by token
            seq.token_ids.append(tok)
            self._detokenize(seq)
        if not 0 <= emitted_chars <= len(seq.output_text):
            raise ValueError(f"emitted_chars={emitted_chars} is outside the resumed text "
                             f"({len(seq.output_text)} characters)")
        seq.emitted_chars = emitted_chars
        seq.resumed = True

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its last output says finish_reason "abort" (the next
        ``step`` returns it, unless ``take_pending`` took it first)."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self._release(seq)
        self._pending.append(self._output(seq, [], "", None, "abort"))
        return True

    def take_pending(self, request_id: str) -> list[RequestOutput]:
        """The outputs of ``request_id`` not tied to a step (its abort), taken out of the next step's."""
        mine = [o for o in self._pending if o.request_id == request_id]
        self._pending = [o for o in self._pending if o.request_id != request_id]
        return mine

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self._pending) or self._ahead is not None
                or any(self.seqs[rid].status is Status.RUNNING for rid in self.rings))

    def best_priority(self) -> int | None:
        """The best (lowest) priority among the sequences the next step may run; None: none."""
        return min((s.priority for s in (*self.scheduler.running, *self.scheduler.waiting)), default=None)

    def stats(self) -> dict:
        by_priority: dict[int, int] = {}
        by_owner: dict[str, dict[int, int]] = {}
        for seq in self.scheduler.waiting:
            by_priority[seq.priority] = by_priority.get(seq.priority, 0) + 1
            mine = by_owner.setdefault(seq.owner, {})
            mine[seq.priority] = mine.get(seq.priority, 0) + 1
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running) + len(self.rings),
                "waiting_by_priority": by_priority, "waiting_by_owner": by_owner,
                "parked": sum(s.status is Status.PARKED for s in self.seqs.values()),
                "free_kv_blocks": self.blocks.num_free, "total_kv_blocks": self.blocks.num_blocks,
                "max_running": self.scheduler.max_num_seqs, "preemptions": self.scheduler.num_preemptions, "kv_tokens": self.kv_tokens(),
                **retention.stats(self.residency)}

    def kv_tokens(self) -> dict[str, list[int]]:
        """Running requests: id -> [tokens now, tokens at its end (prompt + max_tokens, within
        the context), members of its ring (1: this engine alone)] — what the router's spreading
        policy weighs (a ring session's blocks are reserved for its whole range at admission)."""
        out = {s.request_id: [s.num_tokens, min(s.num_prompt_tokens + s.params.max_tokens, self.max_context), 1]
               for s in self.scheduler.running}
        for rid, (ring, sid) in self.rings.items():
            s, sess = self.seqs.get(rid), ring.sessions.get(sid)
            if s is not None and sess is not None:
                out[rid] = [s.num_tokens, sess.ranges[-1][1], len(ring.members)]
        return out

    # ---- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            chunks = self.scheduler.schedule()
            if not chunks:
                self._report_chunks()
                return outputs + self._ring_steps()
            ahead = self._launch_ahead(chunks)
            if ahead is None:
                return outputs + self._run(chunks) + self._ring_steps()
        # Launched ahead (TANDEM_GPU_AHEAD=1): where the graph chose every token, the next decode
        # step goes out before this one's tokens are read (``_feed``): the GPU runs it while the
        # host makes this step's text and the caller hands the outputs on. Where the host chooses
        # a row's token, this step is read and completed first; the next one goes out next call.
        # A next step that is not decode only is scheduled again by the next call and runs there.
        done = self._feed(*ahead)
        if done is None:
            done = self._collect(*ahead)
        return outputs + done + self._ring_steps()

    def _live(self, chunks: list[ScheduledChunk]) -> list[int]:
        """The chunks of a step launched ahead whose sequences are still here to take their
        token (not aborted or moved away since the launch)."""
        return [k for k, c in enumerate(chunks)
                if c.seq.status is Status.RUNNING and self.seqs.get(c.seq.request_id) is c.seq]

    def _feed(self, chunks: list[ScheduledChunk], launched) -> list[RequestOutput] | None:
        """A step launched ahead whose every token the graph chose (greedy argmax or a device
        draw, nothing read on the host): the next decode step is scheduled and launched before
        its tokens are read — each sequence advanced by a placeholder token, the next step's id
        taken from this step's token on the device — then this step's tokens replace the
        placeholders and make their outputs. None (nothing done) where a row's token is the
        host's to choose."""
        live = [(k, chunks[k]) for k in self._live(chunks)]
        chosen = self.graphs.chosen(launched)
        if not all(chosen[k] and sampler.plain(c.seq) for k, c in live):
            return None
        self.scheduler.commit([c for _, c in live])
        for _, c in live:
            c.seq.token_ids.append(PLACEHOLDER)
        # The next step is scheduled before this one's tokens are known, so a sequence this step ends
        # (EOS, a stop) still holds its blocks and asks for its next slot: where that schedule could
        # preempt another sequence on its account, this step is read first and the next one
        # scheduled after. (A sequence this token fills ends here: its row would be computed and dropped.)
        nxt = [c for c in self.scheduler.schedule() if not self._full(c.seq)] if self.scheduler.decodes_fit() else []
        if nxt:
            self._ahead = self._launch_ahead(nxt, (launched, {id(c.seq): k for k, c in live}))
        _, tokens = self.graphs.collect(launched)
        for k, c in live:
            c.seq.token_ids[-1] = tokens[k]
        if self.chunk_events is not None:
            for _, c in live:
                self.chunk_events.note_seq(c.seq)
            self._report_chunks()
        return [self._appended(c.seq, tokens[k], None) for k, c in live]

    def _run(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """One step of the scheduled ``chunks``, start to end: the forward pass (a decode-only
        one replayed from the decode graphs where they exist), the tokens sampled and appended."""
        sampled = [c.seq for c in chunks if c.sample]
        constrained = [s.matcher for s in sampled if s.matcher is not None]
        if constrained:  # the masks sampling needs, computed for the batch at once
            self.grammar.fill_masks([s.matcher for s in sampled if s.matcher is not None and sampler.needs_mask(s)])
        ran = self.graphs.try_step(chunks) if self.graphs is not None else None  # a decode-only step, replayed
        if ran is not None:
            logits, greedy = ran
        else:
            token_ids, ctx = self._build_context(chunks)
            logits, greedy = self.model.forward(token_ids, ctx, self.kv), None
        step_out = self._complete(chunks, sampled, logits, greedy)
        if constrained:   # (one output a sequence of ``sampled``, in order, but for one that failed)
            self._fast_forward([s for s in sampled if s.status is not Status.FAILED], step_out)
        return step_out

    def _complete(self, chunks: list[ScheduledChunk], sampled: list[Sequence], logits: torch.Tensor,
                  greedy) -> list[RequestOutput]:
        """After the forward pass of ``chunks``: committed, the tokens of ``sampled`` (the
        sequences of its sampling chunks) chosen (``greedy``: the graph's, ``sampler.sample``) and
        appended."""
        self.scheduler.commit(chunks)
        if self.chunk_events is not None:
            for c in chunks:
                self.chunk_events.note_seq(c.seq)
            self._report_chunks()
        failed: dict[int, Exception] = {}
        tokens, lps = sampler.sample(logits, sampled, greedy, failed)
        for k, e in failed.items():
            self._fail(sampled[k], e, "its token could not be chosen")
        return [self._append(seq, tok, lp) for k, (seq, tok, lp) in enumerate(zip(sampled, tokens, lps))
                if k not in failed]

    def _launch_ahead(self, chunks: list[ScheduledChunk], feed: tuple | None = None) -> tuple | None:
        """(chunks, the launched step) where the decode graphs run ahead and ``chunks`` are a
        decode-only step with no grammar (its masks need the last token's text state) on an
        engine with no ring sessions; else None. ``feed``: ``DecodeGraphs.launch``'s."""
        g = self.graphs
        if g is None or not g.ahead or self.rings or any(c.seq.matcher is not None for c in chunks):
            return None
        launched = g.launch(chunks, feed)
        return None if launched is None else (chunks, launched)

    def _collect(self, chunks: list[ScheduledChunk], launched) -> list[RequestOutput]:
        """A step launched ahead, read back (the wait for the GPU) and completed — the rows of
        sequences no longer here dropped."""
        logits, greedy = self.graphs.collect(launched)
        keep = self._live(chunks)
        if len(keep) < len(chunks):
            if not keep:
                return []
            chunks, greedy = [chunks[k] for k in keep], [greedy[k] for k in keep]
            logits = logits[torch.tensor(keep, device=logits.device)]
        return self._complete(chunks, [c.seq for c in chunks], logits, greedy)   # (decode only: every chunk samples)

    # ---- ring sessions (cpu-ring(N): shared/ring/) ---------------------------------
    def add_ring(self, request_id: str, blob, ring, sid: str, priority: int | None = None) -> None:
        """Decode the sequence exported in ``blob`` on ``ring``, which holds its KV as session
        ``sid`` (``Ring.admit``): each step of this engine also runs one ring step of it, sampled
        here like any sequence. The context is the model's, not this engine's cache."""
        h, _ = KVBlobHeader.parse(blob)
        seq = self._imported(request_id, h, priority)
        seq.num_computed = h.num_computed
        seq.context_limit = ring.kernels.max_context
        seq.status = Status.RUNNING
        self.seqs[request_id] = seq
        self.rings[request_id] = (ring, sid)

    def _fail(self, seq: Sequence, e: Exception, what: str) -> None:
        """End ``seq`` with the error ``e`` (``take_failed`` hands it on); the rest of its step goes on."""
        log.warning("%s: %s: %s", seq.request_id, what, e)
        if self.seqs.get(seq.request_id) is seq:
            del self.seqs[seq.request_id]
        self._release(seq)
        seq.status = Status.FAILED
        self._failed.append((seq.request_id, e))

    def take_failed(self) -> list[tuple[str, Exception]]:
        """Requests that ended with an error since the last call (a ring member was lost, a token
        that could not be chosen)."""
        if not self._failed:   # every step asks: no new list then
            return self._failed
        out, self._failed = self._failed, []
        return out

    def _ring_steps(self) -> list[RequestOutput]:
        outs = []
        for rid, (ring, sid) in list(self.rings.items()):
            seq = self.seqs[rid]
            if seq.status is Status.PARKED:   # being moved (export_kv keep=True)
                continue
            try:
                if seq.matcher is not None and sampler.needs_mask(seq):
                    self.grammar.fill_masks([seq.matcher])
                logits = ring.step(sid)
            except Exception as e:  # a member lost: the request ends here, with the error
                self._fail(seq, e, "ring step failed")
                continue
            seq.num_computed += 1
            failed: dict[int, Exception] = {}
            tokens, lps = sampler.sample(logits, [seq], failed=failed)
            if failed:
                self._fail(seq, failed[0], "its token could not be chosen")
                continue
            ring.append(sid, tokens[0])
            outs.append(self._append(seq, tokens[0], lps[0]))
        return outs

    def _fast_forward(self, seqs: list[Sequence], outs: list[RequestOutput]) -> None:
        """Append the tokens a grammar forces (the only token it allows next: a JSON key of the
        schema, a closing quote...) without a decode step each; the next step computes them as
        one chunk. The output is the same as decoding them one by one (sampling from a row with
        one allowed token gives that token), in fewer forward passes. Only states whose next
        byte is forced can force a token: their masks are computed for the batch at once; the
        rest (inside a free string, most of the time) cost no mask. Not with logprobs (a forced
        token's logprob needs its logits), nor on a prefill worker. ``outs`` (one per seq) gain
        the forced tokens."""
        live = [k for k, s in enumerate(seqs) if s.matcher is not None and not outs[k].finished
                and s.status is Status.RUNNING and not (s.params.logprobs or s.params.top_logprobs
                                                        or s.prefill_only)]
        while live:
            live = [k for k in live if seqs[k].matcher.may_force()]
            self.grammar.fill_masks([seqs[k].matcher for k in live])
            forced = []
            for k in live:
                seq = seqs[k]
                tok = seq.matcher.forced()
                if tok is None or tok in self.eos_ids:
                    continue
                outs[k] = merge_outputs(outs[k], self._append(seq, tok, None))
                if not outs[k].finished:
                    forced.append(k)
            live = forced

    # ---- grammar ------------------------------------------------------------------------
    @property
    def grammar(self) -> grammar.GrammarCompiler:
        if self._grammar is None:
            self._grammar = grammar.GrammarCompiler(self.tokenizer)
        return self._grammar

    def _attach_guide(self, seq: Sequence) -> None:
        """Build ``seq``'s matcher from its guide and its output so far (ValueError: a guide that
        does not compile, or an output it rejects)."""
        if seq.params.guide is not None:
            seq.matcher = self.grammar.matcher(seq.params.guide, seq.output_token_ids)

    @torch.inference_mode()
    def warm_up(self) -> float:
        """One short forward pass before the first request, on the thread that runs the steps:
        the weights' pages (memory-mapped from the weight cache) are faulted in and the kernels'
        thread team exists, so the first request does not pay for them (~0.2 s on a 2-core VM);
        on CUDA the Triton kernels compile and the decode graphs are captured.
        Returns the seconds it took; the engine's state is unchanged."""
        t0 = time.perf_counter()
        self.prompt_logits([0] * self.layout.block_size)
        if self.device.type == "cuda":
            # Triton compiles a kernel per specialization of its integer arguments (1, multiples of
            # 16, the rest) and per tile (16 / 32 / 64 rows): prompts of these lengths compile the
            # prefill variants now, not inside a request's time to first token; the last one's
            # matmuls go through cuBLAS (kernels/gpu_step.py GEMM_ROWS), which sets itself up then
            for n in (5, 17, 32, 65, 80, 160):
                self.prompt_logits([0] * n)
        if self.graphs is not None:   # CUDA: every bucket's decode graph captured before the first request
            log.info("decode graphs captured for %d batch sizes", self.graphs.warm_up())
        return time.perf_counter() - t0

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], prefix_kv: bytes | None = None) -> torch.Tensor:
        """Logits [len(token_ids), vocab] at every position of one prompt, in one forward pass
        (for evaluation: parity with other implementations, perplexity). Uses free KV blocks and
        gives them back; requests in the engine are not disturbed. ``prefix_kv``: the KV of the
        first whole blocks (e.g. decoded from the KV pool); then only the positions after it are
        computed and returned."""
        n, bs = len(token_ids), self.layout.block_size
        start = 0 if prefix_kv is None else len(prefix_kv) // self.layout.token_bytes
        if start % bs or start >= n:
            raise ValueError(f"prefix KV must hold whole blocks and fewer than {n} tokens, got {start}")
        blocks = self.blocks.allocate(self.layout.blocks_for(n))
        if blocks is None:
            raise EngineFull(f"{n} tokens need {self.layout.blocks_for(n)} KV blocks, {self.blocks.num_free} free")
        try:
            table = torch.tensor(blocks, dtype=torch.int64)
            if start:
                data = torch.frombuffer(bytearray(prefix_kv), dtype=torch.uint8).view(KV_DTYPE)
                self.kv[table[:start // bs].to(self.device)] = data.view(-1, *self.layout.block_shape).to(self.device)
            pos = torch.arange(start, n, dtype=torch.int64)
            ctx = StepContext(pos.to(self.device), table[pos // bs].to(self.device), (pos % bs).to(self.device),
                              [AttnChunk(start, n - start, 0, table.to(self.device), blocks)],
                              torch.arange(n - start, device=self.device))
            ids = torch.tensor(token_ids[start:], dtype=torch.int64, device=self.device)
            return self.model.forward(ids, ctx, self.kv)
        finally:
            self.blocks.release(blocks)

    def _build_context(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, StepContext]:
        bs, dev = self.layout.block_size, self.device
        ids, pos, attn, sample_rows = [], [], [], []
        off = 0
        for c in chunks:
            seq = c.seq
            ids.extend(seq.token_ids[c.start:c.start + c.num_tokens])
            pos.extend(range(c.start, c.start + c.num_tokens))
            nb = self.layout.blocks_for(c.start + c.num_tokens)
            ids_nb = seq.block_table[:nb]
            attn.append(AttnChunk(c.start, c.num_tokens, off, torch.tensor(ids_nb, device=dev), ids_nb))
            off += c.num_tokens
            if c.sample:
                sample_rows.append(off - 1)
        positions = torch.tensor(pos, dtype=torch.int64)
        tables = [c.seq.block_table for c in chunks for _ in range(c.num_tokens)]
        slot_blocks = torch.tensor([t[p // bs] for t, p in zip(tables, pos)], dtype=torch.int64)
        ctx = StepContext(positions.to(dev), slot_blocks.to(dev), (positions % bs).to(dev), attn,
                          torch.tensor(sample_rows, dtype=torch.int64, device=dev))
        return torch.tensor(ids, dtype=torch.int64, device=dev), ctx

    def _append(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> RequestOutput:
        seq.token_ids.append(tok)
        return self._appended(seq, tok, lp)

    def _full(self, seq: Sequence) -> bool:
        """Has ``seq`` all the tokens it may have (max_tokens, the context)?"""
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= (seq.context_limit or self.max_context)

    def _appended(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> RequestOutput:
        """The output of ``tok``, just appended to ``seq.token_ids``: its text, and the end of the
        sequence where it ends it."""
        p = seq.params
        finish = None
        new_ids: list[int] = []
        new_lps: list[TokenLogprob] | None = [] if lp is not None else None
        if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            finish = "stop"  # counted as generated, never shown
        else:
            new_ids.append(tok)
            old = len(seq.output_text)
            if lp is not None:
                (seq.held_logprobs.append((old, lp)) if p.stop else new_lps.append(lp))
            self._detokenize(seq)
            if p.stop:
                if seq.stops is None:  # the first output here (also after a hand-off / resume)
                    seq.stops = StopMatcher(p.stop, seq.output_text[seq.emitted_chars:old])
                cut = seq.stops.feed(seq.output_text[old:])
                if cut:
                    seq.output_text = seq.output_text[:len(seq.output_text) - cut]
                    finish = "stop"
                    # the stop string's tokens: their logprobs go with their text
                    seq.held_logprobs = [h for h in seq.held_logprobs if h[0] < len(seq.output_text)]
            if seq.matcher is not None and (not seq.matcher.accept(tok) or seq.matcher.done):
                if seq.matcher.error:  # the mask allowed only what the grammar accepts: a bug
                    log.warning("%s: grammar rejected token %d: %s", seq.request_id, tok, seq.matcher.error)
                finish = "stop"  # the grammar is complete: nothing but EOS could follow
        if finish is None and self._full(seq):
            finish = "length"
            self._detokenize(seq, final=True)  # a character cut by the limit shows as U+FFFD
        end = len(seq.output_text)
        if finish is None and seq.stops is not None:
            end -= seq.stops.holdback
        text = seq.output_text[seq.emitted_chars:end] if end > seq.emitted_chars else ""
        seq.emitted_chars = max(seq.emitted_chars, end)
        if seq.held_logprobs:
            # a token's logprob goes out with its text (all of them where the sequence ends here,
            # or leaves this engine: a prefill worker's first token)
            out = finish is not None or seq.prefill_only
            new_lps = [lp for start, lp in seq.held_logprobs if out or start < end]
            seq.held_logprobs = [] if out else [h for h in seq.held_logprobs if h[0] >= end]
        if finish is not None:
            self.seqs.pop(seq.request_id, None)
            if self.finished_kv_hook is not None and seq.request_id not in self.rings:
                self._report_finished_kv(seq)
            retention.finished(self, seq)
            self._release(seq)
            seq.status, seq.finish_reason = Status.FINISHED, finish
        elif seq.prefill_only:  # keep the KV for export_kv; the decode worker continues
            self.scheduler.remove(seq)
            seq.status, finish = Status.PARKED, "prefilled"
        return self._output(seq, new_ids, text, new_lps, finish)

    def _detokenize(self, seq: Sequence, final: bool = False) -> None:
        """Extend seq.output_text with the new tokens' text (never half a UTF-8 character)."""
        delta, seq.prefix_offset, seq.read_offset = decode_step(
            self.tokenizer, seq.token_ids, seq.prefix_offset, seq.read_offset, final)
        seq.output_text += delta

    def _output(self, seq, ids, text, lps, finish) -> RequestOutput:
        out = RequestOutput(seq.request_id, ids, text, finish is not None, finish, lps,
                            seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_output_tokens)
        if seq.resumed and seq.resume_reused is not None and not seq.resume_reported:
            seq.resume_reported = True   # the first output of a resumed request says what it cost
            out.reused_tokens = seq.resume_reused
            out.recomputed_tokens = seq.num_tokens - 1 - seq.resume_reused
        return out

    def set_priority(self, request_id: str, priority: int) -> None:
        """Run a request at another priority from its next step (its session's tier changed and
        its pool did not): a waiting one takes its place in the new tier's queue (fair share
        included), a running one is preempted and preempts as the new tier. KeyError: unknown."""
        seq = self.seqs[request_id]
        if seq.priority == priority:
            return
        waiting = seq in self.scheduler.waiting
        if waiting:
            self.scheduler.waiting.remove(seq)
        seq.priority, seq.fair_tag = priority, None
        if waiting:
            self.scheduler.add(seq)
        elif seq.status is Status.RUNNING:
            self.scheduler.tag_running(seq)

    def cached_prefix_tokens(self, token_ids: list[int], tenant: str = "") -> int:
        """How many leading tokens of ``token_ids`` this engine's prefix cache holds now for ``tenant``."""
        return len(self.blocks.match_prefix(token_ids, len(token_ids), tenant_salt(tenant))) * self.layout.block_size

    def _release(self, seq: Sequence) -> None:
        ring = self.rings.pop(seq.request_id, None)
        if ring is not None:
            ring[0].release(ring[1])
            ring[0].close()
        self.scheduler.drop(seq)
        if self.chunk_events is not None:
            self.chunk_events.forget(seq.request_id)



@dataclass
class Completion:
    """A finished request, gathered from its outputs (for tests, the CLI and benchmarks)."""
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.logprobs += out.logprobs or []
        self.finish_reason = out.finish_reason
        self.num_prompt_tokens, self.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
        self.num_output_tokens = out.num_output_tokens


def run_to_completion(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]],
                      priority: int = 1) -> dict[str, Completion]:
    """Add ``requests`` (id -> (prompt ids, params)), step until all finish, return their results."""
    done = {rid: Completion(rid) for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add(rid, ids, params, priority)
    pending = set(requests)
    while pending:
        for out in engine.step():
            if out.request_id in done:
                done[out.request_id].add(out)
                if out.finished:
                    pending.discard(out.request_id)
        for rid, e in engine.take_failed():
            if rid in pending:
                raise e
    return done
