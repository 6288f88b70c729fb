"""Sampling parameters and per-request outputs: the engine's public data types."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from shared.engine.grammar import check_guide


# A temperature below this is greedy (as vLLM's): dividing logits by a smaller one overflows float32
# (1e-38 did: every row of the step that sampled it failed), and the distribution is one-hot anyway.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 16            # new tokens at most (finish_reason "length")
    temperature: float = 1.0        # 0 (below GREEDY_BELOW) = greedy
    top_p: float = 1.0              # nucleus mass kept, (0, 1]
    top_k: int = 0                  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0              # drop tokens below min_p * p(most likely); 0 = off
    seed: int | None = None         # per-request RNG seed: same seed, same tokens
    presence_penalty: float = 0.0   # OpenAI: subtract once per token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the output
    repetition_penalty: float = 1.0 # CTRL-style, over prompt + output; 1 = off
    stop: list[str] = field(default_factory=list)          # stop strings (not returned)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (not returned)
    ignore_eos: bool = False        # keep going past the model's end-of-sequence token
    logprobs: bool = False          # return the chosen token's logprob
    top_logprobs: int = 0           # and the n most likely alternatives, 0..20
    guide: dict | None = None       # output constraint, {"kind", "value"} (shared/engine/grammar.py)

    def validate(self) -> "SamplingParams":
        """Raise ValueError naming the first bad field; return self."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "must be a finite number")
        if not 0 <= self.temperature <= 2:       # OpenAI's range, as for the penalties below
            bad("temperature", "must be in [0, 2]")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 = off)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > 16:
            bad("stop", "at most 16 stop strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            bad("top_logprobs", "must be an integer in [0, 20]")
        if self.guide is not None:
            try:
                check_guide(self.guide)
            except ValueError as e:
                bad("guide", str(e))
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return cls(**d)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the most likely tokens, best first


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""
    request_id: str
    token_ids: list[int]                 # tokens new in this step (stop tokens excluded)
    text: str                            # text new in this step (stop strings trimmed)
    finished: bool
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "prefilled" | None
    logprobs: list[TokenLogprob] | None = None  # one per entry of token_ids, when asked for
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0           # prompt tokens whose KV was reused, not computed
    num_output_tokens: int = 0           # generated so far, in total
    reused_tokens: int = -1              # first output of a resumed request: tokens of KV found cached
    recomputed_tokens: int = 0           # ... and computed again (-1 above: not a resume)
    tier: str = ""                       # the tier it runs at, where a backend's router set it (a
                                         # session's tier change overrides the request's): the first output


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``a`` then ``b`` (consecutive outputs of one request) as one output."""
    lps = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    resumed = a if a.reused_tokens >= 0 else b   # the first output of a resumed request says what it cost
    return RequestOutput(a.request_id, a.token_ids + b.token_ids, a.text + b.text, b.finished, b.finish_reason, lps,
                         b.num_prompt_tokens, b.num_cached_tokens, b.num_output_tokens, resumed.reused_tokens,
                         resumed.recomputed_tokens, a.tier or b.tier)
