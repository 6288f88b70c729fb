"""Tokenizer, chat template and streaming detokenizer for a loaded model.

Two sources, one class:
- ``Tokenizer.from_gguf(fields)``: a ``tokenizers.Tokenizer`` rebuilt from llama.cpp metadata
  (``tokenizer.ggml.*``): "gpt2" -> byte-level BPE with the split regex of ``tokenizer.ggml.pre``,
  "llama" -> SentencePiece-style BPE with byte fallback (merges from the file, or derived from
  the token scores when the file has none). CONTROL tokens become special tokens and
  USER_DEFINED tokens plain added tokens, so neither is ever split.
- ``Tokenizer.from_dir(path)``: ``tokenizer.json`` (+ ``tokenizer_config.json``,
  ``chat_template.jinja``, ``generation_config.json``) of a Hugging Face model directory.

The chat template is rendered as Hugging Face renders it: a sandboxed jinja2 environment with
``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, ``tojson`` and the
special token strings as variables.

Streaming: ``decode_step`` turns token ids, fed one at a time, into text deltas that never cut
a multi-byte UTF-8 character (vLLM's prefix/read offset scheme, see its docstring).
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any, Callable

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Text that ends a turn in the common chat formats; any of these in the vocabulary stops generation.
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
              "<|end|>", "</s>", "<end_of_turn>")

# ---- pre-tokenizer regexes, by tokenizer.ggml.pre (as in llama.cpp's llama-vocab.cpp) -------
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# pre name -> (regex, split digits one by one first)
_PRE_SPLITS: dict[str, tuple[str, bool]] = {
    "default": (_GPT2_SPLIT, False),
    "gpt-2": (_GPT2_SPLIT, False),
    "gpt2": (_GPT2_SPLIT, False),
    "smollm": (_GPT2_SPLIT, True),
    "starcoder": (_GPT2_SPLIT, True),
    "refact": (_GPT2_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, False),
    "llama-v3": (_LLAMA3_SPLIT, False),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "smaug-bpe": (_LLAMA3_SPLIT, False),
    "dbrx": (_LLAMA3_SPLIT, False),
    "falcon3": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
    "megrez": (_QWEN2_SPLIT, False),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def _split_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    regex, digits = _PRE_SPLITS.get(pre or "default", _PRE_SPLITS["default"])
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps)


def _bpe(**kwargs) -> models.BPE:
    """``tokenizers.models.BPE``, with its construction errors (plain Exception) as ValueError."""
    try:
        return models.BPE(**kwargs)
    except Exception as e:  # tokenizers raises bare Exception for a bad vocabulary / merges
        problem = f"bad tokenizer vocabulary: {e}"
    raise ValueError(problem)


def _derive_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges from the vocabulary: every split of a token into two tokens,
    ordered by the merged token's score (best first), then by the left piece's id."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for tok, score in zip(tokens, scores):
        for i in range(1, len(tok)):
            a, b = tok[:i], tok[i:]
            if a in vocab and b in vocab:
                ranked.append((-score, vocab[a], vocab[b], a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def _render_env():
    """The jinja2 environment Hugging Face renders chat templates in."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: HF marks assistant text with it; renders the body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    ``id_to_piece(i)`` is the raw vocabulary string of a token (byte-level or ▁ spelling); for
    streaming text use ``decode_step``, which decodes growing windows of ids instead.
    """

    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 extra_eos_ids: set[int] = frozenset(), add_bos: bool = False,
                 chat_template: str | None = None, special_strings: dict[str, str | None] | None = None):
        self.backend = backend                      # the tokenizers.Tokenizer doing the work
        self.bos_token_id = bos_token_id            # None when the model has none
        self.eos_token_id = eos_token_id            # the model's end-of-sequence token
        self.add_bos = add_bos                      # encode() prepends BOS (add_special_tokens=True)
        self.chat_template = chat_template          # jinja2 source, or None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        # every token that ends generation: eos + the end-of-turn tokens the vocabulary has
        self.eos_token_ids: set[int] = set(extra_eos_ids)
        if eos_token_id is not None:
            self.eos_token_ids.add(eos_token_id)
        added = {a.content: i for i, a in backend.get_added_tokens_decoder().items()}
        self.eos_token_ids.update(added[t] for t in END_TOKENS if t in added)
        # variables the chat template sees (bos_token, eos_token, ...)
        self.special_strings = dict(special_strings or {})
        for name, tid in (("bos_token", bos_token_id), ("eos_token", eos_token_id)):
            if tid is not None:
                self.special_strings.setdefault(name, self.id_to_piece(tid))
        self._template = None
        self._max_piece: int | None = None          # min_tokens' longest piece (0: no bound)

    def to_dict(self) -> dict:
        """Everything ``from_dict`` needs, JSON-serializable (the weight cache stores it)."""
        return {"backend": self.backend.to_str(), "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id, "eos_token_ids": sorted(self.eos_token_ids),
                "add_bos": self.add_bos, "chat_template": self.chat_template,
                "special_strings": self.special_strings}

    @classmethod
    def from_dict(cls, d: dict) -> "Tokenizer":
        return cls(HFTokenizer.from_str(d["backend"]), bos_token_id=d["bos_token_id"],
                   eos_token_id=d["eos_token_id"], extra_eos_ids=set(d["eos_token_ids"]), add_bos=d["add_bos"],
                   chat_template=d["chat_template"], special_strings=d["special_strings"])

    # ---- encode / decode -------------------------------------------------------------------

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))`` without encoding it: every character is at least
        a byte of some token, and no token spells more than the longest vocabulary piece's UTF-8
        bytes (a byte-level piece's character is one byte of text; its UTF-8 is one or two). 0
        where a normalizer may drop text (no bound then). What lets the gateway refuse a 30 MiB
        prompt for an 8K context at once: encoding it took minutes and gigabytes first."""
        if self._max_piece is None:
            self._max_piece = 0 if self.backend.normalizer is not None else max(
                len(p.encode()) for p in self.backend.get_vocab(with_added_tokens=True))
        return len(text) // self._max_piece if self._max_piece else 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text map to their ids.
        With ``add_special_tokens``, BOS is prepended when the model asks for it."""
        # encode_batch, not encode: the same ids, but it lets go of the GIL while it works (encode
        # holds it: 3.6 s for a 5 MB text, during which the gateway's event loop, its streams and
        # its heartbeats all stood still, though the text was tokenized in a pool thread)
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str | None:
        """The vocabulary string of one token (not display text; see ``decode_step``)."""
        return self.backend.id_to_token(int(token_id))

    def token_to_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for — part of a character where a character takes several
        tokens, which ``decode`` shows as U+FFFD (logprobs' ``bytes``): a byte-level BPE piece
        through the byte alphabet, a SentencePiece byte token ``<0xNN>`` as that byte, ``▁`` as
        a space; an added token as its text; else the token's decoded text."""
        piece = self.id_to_piece(token_id)
        if piece is None:
            return b""
        if int(token_id) in self.backend.get_added_tokens_decoder():
            return piece.encode()
        if type(self.backend.decoder).__name__ == "ByteLevel":
            inverse = _unicode_to_bytes()
            if all(c in inverse for c in piece):
                return bytes(inverse[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        elif "▁" in piece:
            return piece.replace("▁", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def is_special(self, token_id: int) -> bool:
        tok = self.backend.get_added_tokens_decoder().get(int(token_id))
        return bool(tok is not None and tok.special)

    # ---- chat template ---------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template, as transformers does.
        Extra keyword arguments (``tools``, ``documents``, ``enable_thinking``...) reach the template."""
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer.chat_template / "
                             "tokenizer_config.json chat_template); send a plain completion instead")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of dicts with 'role' and 'content'")
        if self._template is None:
            self._template = _render_env().from_string(self.chat_template)
        variables = {k: v for k, v in self.special_strings.items() if v is not None}
        variables.update(kwargs)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    # ---- builders --------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, get: Callable[[str, Any], Any]) -> "Tokenizer":
        """From GGUF metadata; ``get(key, default)`` returns a field's value. Raises ValueError."""
        model = get("tokenizer.ggml.model", None)
        tokens = get("tokenizer.ggml.tokens", None)
        if model is None or tokens is None:
            raise ValueError("GGUF has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
        tokens = list(tokens)
        types = get("tokenizer.ggml.token_type", None)
        types = [TOKEN_NORMAL] * len(tokens) if types is None else [int(x) for x in types]
        merges = get("tokenizer.ggml.merges", None)
        if model == "gpt2":
            spelling = _bytes_to_unicode()
            alphabet = set(spelling.values())
            # a few files store some tokens in plain UTF-8; respell those in the byte alphabet
            spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
            vocab = {t: i for i, t in enumerate(spelled)}
            pairs = [tuple(m.split(" ", 1)) for m in (merges or [])]
            backend = HFTokenizer(_bpe(vocab=vocab, merges=pairs, ignore_merges=False))
            backend.pre_tokenizer = _split_pre_tokenizer(get("tokenizer.ggml.pre", None))
            backend.decoder = decoders.ByteLevel()
            add_bos = bool(get("tokenizer.ggml.add_bos_token", False))
            # a CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel; skip it
            specials = [tokens[i] for i, ty in enumerate(types) if ty == TOKEN_CONTROL and set(tokens[i]) <= alphabet]
        elif model == "llama":
            vocab = {t: i for i, t in enumerate(tokens)}
            if merges:
                pairs = [tuple(m.split(" ", 1)) for m in merges]
            else:
                scores = get("tokenizer.ggml.scores", None)
                if scores is None:
                    raise ValueError("SentencePiece GGUF has neither tokenizer.ggml.merges nor tokenizer.ggml.scores")
                pairs = _derive_merges(tokens, list(scores))
            unk_id = get("tokenizer.ggml.unknown_token_id", None)
            backend = HFTokenizer(_bpe(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                       unk_token=tokens[unk_id] if unk_id is not None else None))
            prefix = bool(get("tokenizer.ggml.add_space_prefix", True))
            backend.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
            steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            if prefix:
                steps.append(decoders.Strip(content=" ", left=1))
            backend.decoder = decoders.Sequence(steps)
            add_bos = bool(get("tokenizer.ggml.add_bos_token", True))
            specials = [tokens[i] for i, ty in enumerate(types) if ty == TOKEN_CONTROL]
        else:
            raise ValueError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); supported: gpt2, llama")
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
        user = [tokens[i] for i, ty in enumerate(types) if ty == TOKEN_USER_DEFINED]
        if user:
            backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

        def tid(key: str) -> int | None:
            v = get(key, None)
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        extra = {i for i in (tid("tokenizer.ggml.eot_token_id"), tid("tokenizer.ggml.eom_token_id")) if i is not None}
        specials_map = {name: tokens[i] for name, key in (("unk_token", "unknown_token_id"),
                                                           ("pad_token", "padding_token_id"))
                        if (i := tid(f"tokenizer.ggml.{key}")) is not None}
        return cls(backend, bos_token_id=tid("tokenizer.ggml.bos_token_id"),
                   eos_token_id=tid("tokenizer.ggml.eos_token_id"), extra_eos_ids=extra, add_bos=add_bos,
                   chat_template=get("tokenizer.chat_template", None), special_strings=specials_map)

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        """From a Hugging Face model directory (tokenizer.json required). Raises ValueError."""
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ValueError(f"no tokenizer.json in {path}")
        try:
            backend = HFTokenizer.from_file(tj)
        except Exception as e:  # tokenizers raises bare Exception on a malformed file
            backend, problem = None, f"cannot read {tj}: {e}"
        if backend is None:
            raise ValueError(problem)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))

        def token_str(v: Any) -> str | None:
            return v.get("content") if isinstance(v, dict) else v

        names = {k: token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos = backend.token_to_id(names["bos_token"]) if names["bos_token"] else None
        eos = backend.token_to_id(names["eos_token"]) if names["eos_token"] else None
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        if eos is None and gen_eos:
            eos = gen_eos[0]
        template = cfg.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        elif not template:
            template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        # tokenizer.json's post-processor already adds BOS where the model wants it; add_bos_token
        # in tokenizer_config.json is honoured only when the post-processor does not do it
        add_bos = bool(cfg.get("add_bos_token", False)) and bos is not None and \
            bos not in backend.encode("a", add_special_tokens=True).ids
        return cls(backend, bos_token_id=bos, eos_token_id=eos, extra_eos_ids=set(gen_eos), add_bos=add_bos,
                   chat_template=template, special_strings={k: v for k, v in names.items() if v})


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def decode_step(tokenizer: Tokenizer, ids: list[int], prefix: int, read: int,
                final: bool = False) -> tuple[str, int, int]:
    """Incremental detokenization (vLLM's scheme): the text ``ids[read:]`` adds, never half a
    UTF-8 character. Returns ``(delta, prefix, read)`` with the offsets to pass next time.

    ``ids[prefix:read]`` is a short window already emitted: decoding it with and without the new
    ids keeps word-leading spaces (SentencePiece's ``▁``) that a lone token would lose. While the
    new text ends in an incomplete character (U+FFFD) nothing is emitted and the offsets stay,
    unless ``final`` (end of generation: emit what is there). Start with ``read = len(prompt)``
    and ``prefix`` a few ids before it.
    """
    prefix_text = tokenizer.decode(ids[prefix:read])
    new_text = tokenizer.decode(ids[prefix:])
    if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
        return "", prefix, read
    return new_text[len(prefix_text):], read, len(ids)
