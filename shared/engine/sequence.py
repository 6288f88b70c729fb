"""One request inside the engine: its tokens, KV blocks, sampler state and output text.

Life cycle: WAITING (queued, or preempted: its KV is dropped and recomputed on resume)
→ RUNNING (prefill in chunks, then one token per step) → FINISHED, or PARKED when the request
asked only for prefill and waits for its KV to be exported to a decode worker.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import random

import torch

from kvpool.keys import tenant_owner, tenant_salt
from shared.engine.sampling import SamplingParams, TokenLogprob

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    FINISHED = "finished"
    FAILED = "failed"     # ended with an error (Engine._fail), not an answer


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 1, prefill_only: bool = False, tenant: str = ""):
        self.request_id = request_id
        self.tenant = tenant                  # its KV is shared only within this tenant ("" = public)
        self.session = ""                     # its session id, when it has one (retention.py)
        self.retention = ""                   # its prompt_cache_retention: "" | in_memory | 24h
        self.salt = tenant_salt(tenant)       # ... by salting its first block hash
        self.owner = tenant_owner(tenant)     # its API key's tenant: the scheduler's fair share
        self.fair_tag: int | None = None      # its place in its tier's queue (Scheduler.add; 0: not fair)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival = next(_arrival)
        self.prefill_only = prefill_only
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []   # content hash of each full block, in order
        self.num_computed = 0                 # tokens whose KV is in the cache
        self.num_cached_tokens = 0            # prompt tokens reused from the prefix cache
        self.pooled_tokens = 0                # leading tokens whose pool chunks a hand-off's sender wrote back
        self.swapped: torch.Tensor | None = None  # KV blocks held in host memory while preempted
        # (start, tokens, one KV block): KV from the pool for prompt tokens [start, start + tokens)
        # that do not fill a block; the scheduler puts it in place when the request starts
        self.partial_kv: tuple[int, int, torch.Tensor] | None = None
        self.finish_reason: str | None = None
        self.resumed = False                  # continues a request that ran elsewhere (Engine.add)
        self.resume_reused: int | None = None  # ... tokens of its KV found cached when it started
        self.resume_reported = False
        self.context_limit = 0                # its longest context (0: the engine's; a ring session: the model's)
        # sampling state: draws are keyed by (seed, output index) (sampler.draw); an unseeded
        # request gets a random seed here, kept in its params so an export carries it
        if params.seed is None:
            self.params = params = dataclasses.replace(params, seed=random.getrandbits(63))
        self.seed = params.seed
        # grammar state (params.guide): a grammar.Matcher fed every output token; built by the
        # engine the sequence runs in, from the guide and the output so far
        self.matcher = None
        # detokenization state: offsets into token_ids (see Detok in engine.py)
        self.prefix_offset = max(0, self.num_prompt_tokens - 6)
        self.read_offset = self.num_prompt_tokens
        self.output_text = ""   # decoded output so far (stop strings trimmed at finish)
        self.emitted_chars = 0  # how much of output_text has been handed out
        self.stops = None       # stops.StopMatcher over output_text, built by the engine at its first output
        # with stop strings: each output token's logprob and where its text starts in output_text,
        # held back with that text (a stop string's tokens are dropped with it)
        self.held_logprobs: list[tuple[int, TokenLogprob]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def sort_key(self) -> tuple[int, int, int]:
        """Queue order: priority (SLA tier), then its fair share's tag (Scheduler.add), then arrival."""
        return (self.priority, self.fair_tag or 0, self.arrival)
