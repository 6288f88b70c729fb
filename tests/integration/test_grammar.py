"""Grammar-constrained decoding in the real engine (bundled model): the output obeys the guide,
and the grammar state moves with the request (KV export/import mid-generation, resume after a
lost worker) so the continuation equals the unmoved output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from shared.engine import grammar
from shared.engine.engine import Completion, Engine, EngineConfig, run_to_completion
from shared.engine.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engines(bundled_model):
    cfg = EngineConfig(num_kv_blocks=64, threads=1)
    return Engine(bundled_model, cfg), Engine(bundled_model, cfg)


@pytest.fixture
def masks(monkeypatch) -> list[bool]:
    """One entry per ``Matcher.mask`` call, True where it computed a mask (not the cached one)."""
    calls: list[bool] = []
    mask = grammar.Matcher.mask

    def counted(self):
        calls.append(self.bits is None)
        return mask(self)
    monkeypatch.setattr(grammar.Matcher, "mask", counted)
    return calls


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                   add_special_tokens=False)


def test_json_schema_output_validates(engines):
    e, _ = engines
    ids = prompt(e, "What is the weather in Paris for the next 3 days? Answer in JSON.")
    params = {f"t{t}": SamplingParams(max_tokens=60, temperature=t, seed=7,
                                      guide={"kind": "json_schema", "value": SCHEMA}) for t in (0.0, 1.0)}
    done = run_to_completion(e, {rid: (ids, p) for rid, p in params.items()})
    for c in done.values():
        assert c.finish_reason == "stop", c.text  # the grammar completed, not the length limit
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object_and_regex(engines):
    e, _ = engines
    ids = prompt(e, "Give me a JSON object describing a cat.")
    done = run_to_completion(e, {
        "obj": (ids, SamplingParams(max_tokens=80, temperature=0, guide={"kind": "json_object"})),
        "re": (ids, SamplingParams(max_tokens=20, temperature=0, guide={"kind": "regex", "value": "(yes|no), [0-9]{2}"})),
    })
    if done["obj"].finish_reason == "stop":
        assert isinstance(json.loads(done["obj"].text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert done["obj"].text.startswith("{")
    assert done["re"].finish_reason == "stop"
    assert re.fullmatch("(yes|no), [0-9]{2}", done["re"].text), done["re"].text


def test_bad_guides_are_value_errors(engines):
    e, _ = engines
    ids = prompt(e, "hi")
    for guide in ({"kind": "json_schema", "value": {"type": "object", "properties": {"a": {"type": "nope"}}}},
                  {"kind": "regex", "value": "(unclosed"}, {"kind": "yaml", "value": "x"},
                  {"kind": "lark", "value": "start: undefined_rule"}):
        with pytest.raises(ValueError):
            e.add("bad", ids, SamplingParams(max_tokens=4, guide=guide))
    assert "bad" not in e.seqs


def _step_until(engine: Engine, rid: str, n_tokens: int, done: Completion) -> None:
    while len(done.token_ids) < n_tokens:
        for out in engine.step():
            if out.request_id == rid:
                done.add(out)
                assert not out.finished


def _finish(engine: Engine, rid: str, done: Completion) -> Completion:
    while done.finish_reason is None:
        for out in engine.step():
            if out.request_id == rid:
                done.add(out)
    return done


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_constrained_request_moved_mid_generation_equals_unmoved(engines, temperature):
    a, b = engines
    ids = prompt(a, "Weather in Oslo for 4 days, as JSON please.")
    params = SamplingParams(max_tokens=60, temperature=temperature, seed=11,
                            guide={"kind": "json_schema", "value": SCHEMA})
    want = run_to_completion(a, {"ref": (ids, params)})["ref"]
    jsonschema.validate(json.loads(want.text), SCHEMA)

    done = Completion("mv")
    a.add("mv", ids, params)
    _step_until(a, "mv", 5, done)
    blob = a.export_kv("mv")
    b.import_kv("mv", blob)  # the receiving engine rebuilds the matcher from guide + output tokens
    got = _finish(b, "mv", done)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert b.seqs == {} and a.seqs == {}


def test_constrained_request_resumed_elsewhere_equals_unmoved(engines):
    a, b = engines
    ids = prompt(a, "Weather in Rome for 2 days, as JSON.")
    params = SamplingParams(max_tokens=60, temperature=0.9, seed=3, guide={"kind": "json_schema", "value": SCHEMA})
    want = run_to_completion(a, {"ref": (ids, params)})["ref"]
    # the first worker produced 6 tokens and died; the client had received their text
    head = want.token_ids[:6]
    emitted = len(a.tokenizer.decode(head))
    done = Completion("rs")
    b.add("rs", ids, params, resume_token_ids=head, emitted_chars=emitted)
    got = _finish(b, "rs", done)
    assert head + got.token_ids == want.token_ids
    assert want.text[:emitted] + got.text == want.text


def test_a_mask_bias_bans_exactly_the_disallowed_tokens():
    import numpy as np
    import torch


    vocab = 70  # 2 mask words cover the tokenizer's 64 ids; a padded embedding has more
    bits = np.zeros((2,), dtype=np.int32)
    bits[0] = 0b1010              # tokens 1 and 3
    bits[1] = np.int32(-2**31)    # token 63 (the sign bit)
    bias = grammar.mask_bias(bits, vocab)
    assert bias.shape == (vocab,) and torch.isfinite(bias).nonzero().flatten().tolist() == [1, 3, 63]
    assert bias[1] == 0 and torch.isneginf(bias[0]) and torch.isneginf(bias[69])
    assert [t for t in range(vocab) if grammar.allows(bits, t)] == [1, 3, 63]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_forced_tokens_are_fast_forwarded_with_the_same_output(engines, temperature, masks):
    """Tokens the grammar forces (the schema's keys, quotes) are appended without a decode step
    each; logprobs turn that off (a forced token's logprob needs its logits) and mask every row:
    same tokens, more steps. Greedy without logprobs computes a mask only where its best token is
    banned or the next byte is forced: fewer masks."""
    e, _ = engines
    ids = prompt(e, "What is the weather in Paris for the next 3 days? Answer in JSON.")

    def run(logprobs: bool):
        masks.clear()
        e.add("ff", ids, SamplingParams(max_tokens=60, temperature=temperature, seed=11, logprobs=logprobs,
                                        guide={"kind": "json_schema", "value": SCHEMA}))
        outs, steps = [], 0
        while e.has_work():
            steps += 1
            outs += [o for o in e.step() if o.request_id == "ff"]
        return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs), steps, outs, sum(masks)

    fast, text, fast_steps, outs, fast_masks = run(False)
    slow, slow_text, slow_steps, _, slow_masks = run(True)
    assert fast == slow and text == slow_text
    assert slow_masks >= len(slow)  # every sampled row masked
    if temperature == 0.0:
        assert fast_masks < slow_masks, (fast_masks, slow_masks)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert fast_steps < slow_steps and max(len(o.token_ids) for o in outs) > 1, (fast_steps, slow_steps)


def test_greedy_free_text_under_a_grammar_needs_almost_no_masks(engines, masks):
    """Inside a free JSON string the greedy pick is allowed and no byte is forced: no mask is
    computed for those tokens (a mask costs 3-80 us, the check ~2 us), and the output equals the
    fully masked decode (logprobs mask every row)."""
    e, _ = engines
    ids = prompt(e, "Tell me a long story about a dragon. Answer in JSON.")
    guide = {"kind": "json_schema", "value": {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}},
                                              "required": ["story"]}}
    lazy = run_to_completion(e, {"r": (ids, SamplingParams(max_tokens=48, temperature=0, guide=guide))})["r"]
    lazy_masks = sum(masks)
    full = run_to_completion(e, {"r": (ids, SamplingParams(max_tokens=48, temperature=0, guide=guide,
                                                          logprobs=True))})["r"]
    assert lazy.token_ids == full.token_ids and lazy.text.startswith('{"story":"')
    assert len(lazy.token_ids) == 48 and lazy_masks <= 8, (lazy_masks, lazy.text)
