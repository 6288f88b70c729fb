"""Agent sessions on the default ``tandem up`` (a prefill worker, gpu-decode, cpu-decode, the KV
pool), with the official openai client: a turn's reply is never prefilled again — its KV is
reused by the next turn, through /v1/responses with previous_response_id and through chat with
X-Tandem-Session — and stored responses stay within their tenant's cap. One stack for the module."""

from __future__ import annotations

import re
import uuid

import httpx
import openai
import pytest

from tests.e2e.test_stack import running_stack

pytestmark = pytest.mark.timeout(300)

BLOCK = 16            # the engines' KV block (tokens)
CAP = 3               # stored responses per tenant in this stack
TOOL_OUTPUTS = ["ls: 3 files: main.py, util.py, README.md", "main.py: 120 lines, one function main()",
                "util.py: 40 lines; tests pass"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    env = {"TANDEM_API_KEYS": "alice=standard,bob=standard,carol=standard", "TANDEM_RESPONSES_MAX_PER_TENANT": str(CAP),
           "TANDEM_NATS_STORE_DIR": str(tmp_path_factory.mktemp("nats"))}
    with running_stack(None, [], env) as s:
        yield s


def client(stack, key: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=120)


def reused(prev_in: int, prev_out: int) -> int:
    """What the next turn must find cached at least: the previous prompt and reply, rounded down to
    the block — less the last generated token, whose KV no step computed (the request ended as it
    was sampled)."""
    return (prev_in + prev_out - 1) // BLOCK * BLOCK


def test_a_responses_reply_is_not_prefilled_again(stack):
    c = client(stack)
    model = c.models.list().data[0].id
    prev, seen = None, []
    for out in TOOL_OUTPUTS:
        r = c.responses.create(model=model, input=f"Tool output: {out}. What next?", previous_response_id=prev,
                               instructions="You are a coding agent.", max_output_tokens=40, temperature=0)
        u = r.usage
        seen.append((u.input_tokens, u.output_tokens, u.input_tokens_details.cached_tokens))
        prev = r.id
    for (p_in, p_out, _), (_, _, cached) in zip(seen, seen[1:]):
        assert cached >= reused(p_in, p_out), (seen, [ln for ln in stack.tail().splitlines() if "tandem.router" in ln][-6:])


def test_a_session_chats_reply_is_not_prefilled_again(stack):
    c = client(stack)
    model = c.models.list().data[0].id
    session, messages, seen = f"agent-{uuid.uuid4().hex[:8]}", [], []
    for out in TOOL_OUTPUTS:
        messages.append({"role": "user", "content": f"Tool output: {out}. What next?"})
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                      extra_headers={"X-Tandem-Session": session})
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        seen.append((r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens))
    for (p_in, p_out, _), (_, _, cached) in zip(seen, seen[1:]):
        assert cached >= reused(p_in, p_out), (seen, [ln for ln in stack.tail().splitlines() if "tandem.router" in ln][-6:])


def test_each_fork_of_a_turn_reuses_that_turn(stack):
    """Two replies tried from one turn (an agent retrying, a tree search): the second fork finds the
    trunk's prompt and reply as the first did — the router remembers the session's last turns, not
    only the latest (which is now the first fork's)."""
    c = client(stack, "carol")
    model = c.models.list().data[0].id
    trunk = c.responses.create(model=model, input=f"Tool output: {TOOL_OUTPUTS[0]}. What next?", temperature=0,
                               instructions="You are a coding agent.", max_output_tokens=40)
    need = reused(trunk.usage.input_tokens, trunk.usage.output_tokens)
    for i, out in enumerate(TOOL_OUTPUTS[1:]):
        fork = c.responses.create(model=model, input=f"Tool output: {out}. What next?", previous_response_id=trunk.id,
                                  instructions="You are a coding agent.", max_output_tokens=8, temperature=0)
        assert fork.usage.input_tokens_details.cached_tokens >= need, (i, fork.usage, need, [
            ln for ln in stack.tail().splitlines() if "tandem.router" in ln][-4:])


def test_stored_responses_stay_within_the_tenants_cap(stack):
    c, other = client(stack, "bob"), client(stack, "alice")
    model = c.models.list().data[0].id
    before = evicted(stack)
    kept = other.responses.create(model=model, input="Say hi.", max_output_tokens=2, temperature=0).id
    ids = [c.responses.create(model=model, input=f"Say {i}.", max_output_tokens=2, temperature=0).id
           for i in range(CAP + 2)]
    for rid in ids[:2]:      # the oldest went first
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(rid)
    assert [c.responses.retrieve(rid).id for rid in ids[2:]] == ids[2:]
    with pytest.raises(openai.NotFoundError):   # a conversation cannot go on from a removed one
        c.responses.create(model=model, input="And?", previous_response_id=ids[0], max_output_tokens=2)
    assert other.responses.retrieve(kept).id == kept   # another tenant's are not touched (its own cap)
    assert evicted(stack) >= before + 2


def evicted(stack) -> float:
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    m = re.search(r'^tandem_responses_evicted_total\{cap="entries"\} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0
