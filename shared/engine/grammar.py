"""Grammar-constrained decoding with llguidance: guides, their compilation, per-sequence matchers.

A request's constraint is its ``guide`` (``SamplingParams.guide``), a small dict that travels
with the request everywhere its params go (bus messages, KV blobs):

    {"kind": "json_schema", "value": {...schema...}}   # output is one JSON value of the schema
    {"kind": "json_object", "value": None}             # output is one JSON object
    {"kind": "regex", "value": "[a-z]+"}
    {"kind": "lark", "value": "start: ..."}            # llguidance's Lark dialect

Life of a constrained sequence (``Engine``): the matcher is built when the sequence enters an
engine — from the guide, then fed the sequence's output tokens so far (none for a new request;
the tokens already generated for a request imported from another engine or resumed after its
worker died), so the matcher state is a pure function of (guide, output tokens) and moves
exactly with the request. Each step, a row that samples from the whole distribution (a
temperature, logprobs) gets the mask of allowed next tokens, computed on the CPU for the batch at
once (``fill_masks``), added to its logits row before sampling. A greedy row needs no mask when
its best token is allowed — checked by the matcher in ~2 us (``Matcher.allows``), where a mask
costs 3-80 us — and gets one only when that token is banned. The sampled token is fed back
(``accept``). The end-of-sequence tokens are allowed only where the grammar accepts; a grammar
that is complete stops the sequence.
"""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:   # torch only where a mask is applied: the gateway checks guides without it
    import torch

GUIDE_KINDS = ("json_schema", "json_object", "regex", "lark")


def check_guide(guide: Any) -> None:
    """Structural check of a guide dict (ValueError naming the problem). ``GrammarCompiler``
    checks that the grammar itself compiles."""
    if not isinstance(guide, dict) or set(guide) - {"kind", "value"} or guide.get("kind") not in GUIDE_KINDS:
        raise ValueError(f"guide must be {{'kind': one of {', '.join(GUIDE_KINDS)}, 'value': ...}}")
    kind, value = guide["kind"], guide.get("value")
    if kind == "json_schema" and not isinstance(value, (dict, bool)):
        raise ValueError("a json_schema guide's value must be a JSON schema (an object)")
    if kind in ("regex", "lark") and not (isinstance(value, str) and value):
        raise ValueError(f"a {kind} guide's value must be a non-empty string")


def _lib():
    import llguidance  # imported where first needed: only constrained requests pay for it
    return llguidance


class GrammarCompiler:
    """Turns guides into llguidance grammars for one tokenizer (built once per engine/gateway:
    wrapping a 49k vocabulary takes ~0.1 s), with a small cache of compiled grammars."""

    CACHE = 256

    def __init__(self, tokenizer):
        """``tokenizer``: shared.engine.tokenizer.Tokenizer (its HF ``backend`` and eos ids)."""
        ll = _lib()
        self.vocab_size = tokenizer.vocab_size
        self.mask_words = (self.vocab_size + 31) // 32
        self.eos_ids = sorted(tokenizer.eos_token_ids)
        self.lltok = ll.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids)
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()
        self._executor = None  # llguidance's thread pool for the masks of a whole batch (first use)

    def compile(self, guide: dict) -> str:
        """The llguidance grammar of ``guide``; ValueError when it does not compile."""
        check_guide(guide)
        key = json.dumps(guide, sort_keys=True)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        ll = _lib()
        kind, value = guide["kind"], guide.get("value")
        try:
            if kind == "json_schema":
                grammar = ll.LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
            elif kind == "json_object":
                grammar = ll.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = ll.LLMatcher.grammar_from_regex(value)
            else:
                grammar = ll.LLMatcher.grammar_from_lark(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {kind}: {e}") from None
        err = ll.LLMatcher.validate_grammar(grammar, self.lltok)
        if err:
            raise ValueError(f"invalid {kind}: {err}")
        with self._lock:
            if len(self._cache) >= self.CACHE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = grammar
        return grammar

    def fill_masks(self, matchers: list["Matcher"]) -> None:
        """Compute the masks of the matchers whose current state has none, in parallel on
        llguidance's threads (one call for a whole batch; the GIL is released)."""
        todo = [m for m in matchers if m.bits is None]
        if not todo:
            return
        if len(todo) == 1:
            todo[0].mask()
            return
        if self._executor is None:
            self._executor = _lib().LLExecutor(num_threads=max(1, min(os.cpu_count() or 1, 8)))
        bits = np.empty((len(todo), self.mask_words), dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr([(m.m, k) for k, m in enumerate(todo)], bits.ctypes.data,
                                               bits[0].nbytes, len(todo))
        for k, m in enumerate(todo):
            m.bits = bits[k]

    def matcher_for(self, grammar: str) -> "Matcher":
        return Matcher(_lib().LLMatcher(self.lltok, grammar, log_level=0), self.vocab_size)

    def matcher(self, guide: dict, output_token_ids: list[int] = ()) -> "Matcher":
        """A matcher for ``guide`` that has consumed ``output_token_ids`` (a moved or resumed
        request's history). ValueError when the grammar does not compile or rejects the history."""
        m = self.matcher_for(self.compile(guide))
        if output_token_ids and not m.m.consume_tokens(list(output_token_ids)):
            raise ValueError(f"the output so far does not match the guide: {m.m.get_error()}")
        return m


class Matcher:
    """One sequence's grammar state."""

    def __init__(self, m, vocab_size: int):
        self.m = m                    # llguidance.LLMatcher
        self.vocab_size = vocab_size
        self.bits: np.ndarray | None = None  # the mask of the current state, once computed

    def mask(self) -> np.ndarray:
        """The allowed-next-token bitmask of the current state (int32 words, bit i of word w =
        token 32w+i; computed once per state)."""
        if self.bits is None:
            bits = np.empty(((self.vocab_size + 31) // 32,), dtype=np.int32)
            self.m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            self.bits = bits
        return self.bits

    def allows(self, token_id: int) -> bool:
        """May ``token_id`` come next? From the mask when it is computed, else asked of the
        matcher (no mask needed: ~2 us)."""
        if self.bits is not None:
            return allows(self.bits, token_id)
        return self.m.validate_tokens([token_id]) == 1

    def may_force(self) -> bool:
        """Can the grammar allow only one token next? Not unless its next byte is forced
        (~1 us to ask, no mask): otherwise it allows a token for each possible byte."""
        return self.bits is not None or bool(self.m.compute_ff_bytes())

    def forced(self) -> int | None:
        """The only token the grammar allows next, or None when it allows several."""
        bits = self.mask()
        words = np.flatnonzero(bits)
        if len(words) != 1:
            return None
        w = int(bits[words[0]]) & 0xFFFFFFFF
        if w & (w - 1):
            return None
        return int(words[0]) * 32 + w.bit_length() - 1

    def accept(self, token_id: int) -> bool:
        """Feed the sampled token; False when the grammar rejects it (the matcher is then dead)."""
        self.bits = None
        return self.m.consume_token(token_id)

    @property
    def done(self) -> bool:
        """Nothing but end-of-sequence may follow (the grammar is complete, or in error)."""
        return self.m.is_stopped()

    @property
    def error(self) -> str:
        return self.m.get_error()


def allows(bits: np.ndarray, token_id: int) -> bool:
    """Does the bitmask allow ``token_id``?"""
    w = token_id >> 5
    return w < len(bits) and bool((int(bits[w]) >> (token_id & 31)) & 1)


_NEG_INF_BITS = -8388608   # 0xFF800000 as int32: the bits of float32 -inf


def mask_bias(bits: np.ndarray, vocab: int) -> torch.Tensor:
    """[vocab] float32: 0 where the bitmask allows the token, -inf elsewhere (ids past the mask,
    a padded embedding's, too). Adding it to a row of logits applies the mask: one add, where a
    masked fill with a bool mask costs ~30x more on the CPU."""
    import torch
    words = torch.from_numpy(bits)
    allowed = ((words.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    if allowed.shape[0] < vocab:
        allowed = torch.cat([allowed, torch.zeros(vocab - allowed.shape[0], dtype=torch.int32)])
    return ((allowed - 1) & _NEG_INF_BITS).view(torch.float32)
