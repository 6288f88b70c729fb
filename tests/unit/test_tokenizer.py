"""Tokenizer from GGUF metadata / tokenizer.json against transformers' own GGUF tokenizer."""

from __future__ import annotations

import json
import os

import pytest

from shared.engine.model_files import bundled_model_path, open_gguf
from shared.engine.tokenizer import Tokenizer, decode_step

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "Numbers: 3.14159, 1234567 and 2024-11-23.",
    "unicode: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "emoji: 👍🏽 🤖🎉 family 👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}\n\n\tif x != 0: print(x)",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special tokens inside<|endoftext|>text <|im_end|>and <repo_name> more",
    "newlines\r\n\r\nand\n\n\nmany",
    "",
]
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three primes. 🙂"},
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(bundled_model_path()).get)


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("gguf")
    path = bundled_model_path()
    os.symlink(path, d / os.path.basename(path))
    return transformers.AutoTokenizer.from_pretrained(str(d), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_not_split(ours):
    ids = ours.encode("<|im_start|>assistant<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant<|im_end|>"
    assert ours.decode(ids) == "assistant"


def test_special_ids(ours, theirs):
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.eos_token_id == theirs.eos_token_id == 2
    assert ours.eos_token_ids == {0, 2}  # <|im_end|>, <|endoftext|>
    assert ours.vocab_size == 49152
    assert not ours.add_bos  # tokenizer.ggml.add_bos_token = false
    assert ours.id_to_piece(905) == "Ġworld"


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:]], ids=["system+user", "user-only"])
def test_chat_template_matches_transformers(ours, theirs, messages):
    for gen in (True, False):
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want


def test_no_chat_template_is_a_clear_error(ours):
    bare = Tokenizer(ours.backend, bos_token_id=1, eos_token_id=2, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHAT)


def test_template_raise_exception(ours):
    t = Tokenizer(ours.backend, bos_token_id=1, eos_token_id=2,
                  chat_template="{% if messages|length == 0 %}{{ raise_exception('empty!') }}{% endif %}ok")
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="empty!"):
        t.apply_chat_template([])
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"


def stream(tok, prompt: list[int], gen: list[int]) -> list[str]:
    """Feed ``gen`` one id at a time after ``prompt``, as the engine does; the last call is final."""
    ids, prefix, read, out = list(prompt), max(len(prompt) - 6, 0), len(prompt), []
    for i, t in enumerate(gen):
        ids.append(t)
        delta, prefix, read = decode_step(tok, ids, prefix, read, final=i == len(gen) - 1)
        out.append(delta)
    return out


@pytest.mark.parametrize("text", [TEXTS[3], TEXTS[4], "mixed 日本語 👨‍👩‍👧 and ascii, then 🇫🇷 end"])
def test_incremental_detokenization_equals_full_decode(ours, text):
    ids = ours.encode(text)
    deltas = stream(ours, [], ids)
    assert "".join(deltas) == ours.decode(ids)
    assert all("\ufffd" not in x for x in deltas)


def test_incremental_after_prompt_keeps_leading_space(ours):
    prompt = ours.encode("The answer is")
    gen = ours.encode(" forty-two 🎉 done")
    out = "".join(stream(ours, prompt, gen))
    assert out == " forty-two 🎉 done"


def test_incremental_skips_special_tokens(ours):
    ids = ours.encode("hi<|im_end|> there")
    assert "".join(stream(ours, [], ids)) == ours.decode(ids)


def test_from_dir_equals_from_gguf(ours, tmp_path):
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": ours.chat_template}))
    t = Tokenizer.from_dir(str(tmp_path))
    for text in TEXTS:
        assert t.encode(text) == ours.encode(text)
    assert t.bos_token_id == 1 and t.eos_token_id == 2 and t.eos_token_ids == ours.eos_token_ids
    assert t.apply_chat_template(CHAT) == ours.apply_chat_template(CHAT)


def test_from_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))


def test_sentencepiece_gguf_tokenizer():
    """A "llama" (SentencePiece) vocabulary with no merges: merges derived from scores."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo", "hello", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    scores = [0.0] * 259 + [-1.0 - i for i in range(len(tokens) - 259)]
    scores[tokens.index("▁hello")] = -0.5
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    t = Tokenizer.from_gguf(lambda k, d=None: meta.get(k, d))
    ids = t.encode("hello world")
    assert ids[0] == 1  # SentencePiece vocabularies add BOS by default
    assert [t.id_to_piece(i) for i in ids[1:]] == ["▁hello", "▁world"]
    assert t.decode(ids) == "hello world"
    assert t.decode(t.encode("hé")) == "hé"  # é is not in the vocabulary: byte fallback
    # each token's own bytes (logprobs' "bytes"): joined, the text, é's two byte tokens included
    ids = t.encode("hello hé", add_special_tokens=False)
    assert b"".join(t.token_bytes(i) for i in ids) == " hello hé".encode()
    assert t.token_bytes(tokens.index("<0xC3>")) == b"\xc3" and t.token_bytes(1) == b"<s>"


def test_token_bytes_join_to_the_text_where_a_character_takes_several_tokens(ours):
    """The bundled byte-level vocabulary: an emoji is three tokens, none of them text alone (its
    decode is U+FFFD); their bytes, joined with the rest, are the text's UTF-8."""
    text = "😀😀 héllo <|im_end|>"
    ids = ours.encode(text, add_special_tokens=False)
    parts = [ours.token_bytes(i) for i in ids]
    assert b"".join(parts) == text.encode() and len(ids) > len(text.split())
    assert any(ours.decode([i]) == "\ufffd" and len(p) < 4 for i, p in zip(ids, parts))


def test_a_long_text_is_encoded_without_holding_the_gil(ours):
    """The gateway tokenizes a large request in a pool thread so that its event loop serves the
    other streams meanwhile: that holds only if the encoder lets go of the GIL (``encode`` of
    the `tokenizers` library does not: the loop stood still for 36 s behind a 33 MB prompt)."""
    import threading
    text = "hello world, " * 150_000   # ~2 MB: hundreds of ms of encoding on any machine here
    done, got = threading.Event(), []
    worker = threading.Thread(target=lambda: (got.append(ours.encode(text)), done.set()))
    worker.start()
    ticks = 0
    while not done.wait(0.001):   # this thread needs the GIL for every tick
        ticks += 1
    worker.join()
    assert ticks >= 20, f"the main thread ran {ticks} times while a 2 MB text was encoded"
    assert got[0] == ours.backend.encode(text).ids   # the same ids as the GIL-holding call


def test_min_tokens_is_a_lower_bound_of_the_encoding(ours):
    """``min_tokens`` (the gateway refuses a prompt by it before encoding) never says more tokens
    than the text has: runs of spaces and newlines (the longest pieces), digits (one token each),
    multi-byte characters, special tokens written in the text, code."""
    import random
    rng = random.Random(7)
    texts = [" " * 5000, "\n" + " " * 80 + "x", "1234567890" * 300, "日本語のテキスト" * 200,
             "<|im_start|>user\nhi<|im_end|>" * 100, "def f(x):\n    return x\n" * 200, "é" * 999,
             "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(3000))]
    for t in texts:
        assert ours.min_tokens(t) <= len(ours.encode(t, add_special_tokens=False)), t[:20]
    assert ours.min_tokens("a" * (8192 * 162)) >= 8192   # a text this long cannot fit an 8K context


def test_min_tokens_gives_no_bound_where_a_normalizer_may_drop_text():
    from tokenizers import Tokenizer as HFTokenizer, models, normalizers
    hf = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    hf.normalizer = normalizers.StripAccents()
    t = Tokenizer(hf, bos_token_id=None, eos_token_id=None)
    assert t.min_tokens("a" * 10000) == 0
