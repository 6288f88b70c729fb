"""The Responses API through the whole stack, with the official openai client: string and item
inputs, streamed events that assemble to the non-streamed text, a conversation continued by
previous_response_id from cached KV (and after the whole stack restarted: slow), stored responses
per API key."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.e2e.test_stack import running_stack

pytestmark = pytest.mark.timeout(600)

ARGS = ["--prefill", "0", "--gpu-decode", "0", "--kvpool", "1"]
KEYS = "alice=standard,bob=standard"
INSTRUCTIONS = "You are a helpful assistant. Answer in one short paragraph."


def env_for(tmp) -> dict:
    # pool chunks of one KV block: a short conversation's KV reaches the pool's disk tier too.
    # Codex sets no temperature and no output cap: the deployment's defaults make its answers
    # greedy and bounded (this small model at temperature 1 may ramble to the end of the context)
    return {"TANDEM_API_KEYS": KEYS, "TANDEM_NATS_STORE_DIR": str(tmp / "nats"), "TANDEM_POOL_DIR": str(tmp / "pool"),
            "TANDEM_POOL_CHUNK_TOKENS": "16",
            "TANDEM_GENERATION_DEFAULTS": "temperature=0,max_tokens=256,repetition_penalty=1.2"}


def client(stack, key="alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with running_stack(None, ARGS, env_for(tmp_path_factory.mktemp("responses"))) as s:
        yield s


def turn(c, model, text, previous=None, **kw):
    return c.responses.create(model=model, input=text, instructions=INSTRUCTIONS, previous_response_id=previous,
                              temperature=0, max_output_tokens=24, **kw)


def whole_history(c, model, turns: list[tuple[str, str]], last: str) -> str:
    """The same conversation sent whole (nothing stored): the reference text."""
    items = []
    for user, answer in turns:
        items += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    r = c.responses.create(model=model, input=items + [{"role": "user", "content": last}],
                           instructions=INSTRUCTIONS, temperature=0, max_output_tokens=24, store=False)
    return r.output_text


def test_create_stream_and_items(stack):
    c = client(stack)
    model = c.models.list().data[0].id
    r = turn(c, model, "Name three colours.")
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage.output_tokens > 0
    events = list(c.responses.create(model=model, input="Name three colours.", instructions=INSTRUCTIONS,
                                     temperature=0, max_output_tokens=24, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    items = c.responses.create(model=model, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=24,
                               input=[{"type": "message", "role": "user",
                                       "content": [{"type": "input_text", "text": "Name three colours."}]}])
    assert items.output_text == r.output_text


def test_previous_response_id_continues_from_cached_kv(stack):
    c = client(stack)
    model = c.models.list().data[0].id
    first = turn(c, model, "My name is Ada. Say hello.")
    second = turn(c, model, "What is my name?", previous=first.id)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, second.usage
    assert second.output_text == whole_history(c, model, [("My name is Ada. Say hello.", first.output_text)],
                                               "What is my name?")
    # stored per API key: alice reads and deletes it, bob gets 404
    assert c.responses.retrieve(second.id).output_text == second.output_text
    assert [i.content[0].text for i in c.responses.input_items.list(second.id).data] == ["What is my name?"]
    with pytest.raises(openai.NotFoundError):
        client(stack, "bob").responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        turn(client(stack, "bob"), model, "And now?", previous=second.id)
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": WEATHER}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                        "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["city", "population"], "additionalProperties": False}


def test_a_forced_tool_call_its_output_turn_and_a_json_schema(stack):
    c = client(stack)
    model = c.models.list().data[0].id
    ask = "What is the weather like in Paris today?"
    r = c.responses.create(model=model, input=ask, tools=[TOOL], temperature=0, store=False,
                           tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the tool's result goes back as a function_call_output item: the next turn is served
    after = c.responses.create(model=model, tools=[TOOL], temperature=0, max_output_tokens=32, store=False,
                               input=[{"role": "user", "content": ask},
                                      {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                       "arguments": call.arguments},
                                      {"type": "function_call_output", "call_id": call.call_id,
                                       "output": '{"temperature_c": 21, "sky": "clear"}'}])
    assert after.status in ("completed", "incomplete") and after.output
    # streamed with openai's helper (it refuses an item whose identity changes between added and done):
    # the call_id streamed first is the one the response keeps and stores
    with c.responses.stream(model=model, input=ask, tools=[TOOL], temperature=0, tool_choice="required") as s:
        added = [e.item.call_id for e in s if e.type == "response.output_item.added" and e.item.type == "function_call"]
        final = s.get_final_response()
    assert added and [i.call_id for i in final.output if i.type == "function_call"] == added
    assert [i.call_id for i in c.responses.retrieve(final.id).output if i.type == "function_call"] == added
    js = c.responses.create(model=model, input="Name a big city and its population.", temperature=0, store=False,
                            text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(js.output_text), CITY)


@pytest.mark.slow
def test_a_conversation_continues_after_the_stack_restarts(tmp_path):
    env = env_for(tmp_path)
    with running_stack(None, ARGS, env) as s:
        c = client(s)
        model = c.models.list().data[0].id
        # exactly 24 tokens, so the written-back chunks reach past the first prompt
        first = turn(c, model, "My name is Ada. Say hello.", extra_body={"ignore_eos": True})
    with running_stack(None, ARGS, env) as s:  # everything stopped; the stores kept
        c = client(s)
        second = turn(c, model, "What is my name?", previous=first.id)
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, second.usage
        assert second.output_text == whole_history(c, model, [("My name is Ada. Say hello.", first.output_text)],
                                                   "What is my name?")


# ---- unchanged clients: the Codex CLI and the OpenAI Agents SDK -----------------------------------

CODEX_VERSION = "0.169.0"
CODEX_DIR = Path.home() / ".cache" / "tandem" / f"codex-{CODEX_VERSION}"
CODEX_FLAGS = ["--disable", "multi_agent", "--disable", "goals", "--disable", "view_image", "--disable",
               "image_generation", "--disable", "apps", "--disable", "skill_search", "-c", "web_search=disabled"]
# Codex's own instructions replaced by a short file (with its tool list the request is ~1.9K tokens)
SHORT_INSTRUCTIONS = "You are Codex. When the user greets you, reply exactly: Hi! How can I help? Then stop."
# ~11K tokens of instructions: with Codex's tools the request is larger than the bundled model's 8K
# context. (Codex 0.169's own default request is 6.5K tokens with this tokenizer: it fits.)
LONG_INSTRUCTIONS = "You are Codex, a coding agent running in a terminal. Answer briefly and directly. " * 600


def codex() -> Path:
    """The Codex CLI, installed once from npm into the user's cache (skipped, saying why, without node)."""
    binary = CODEX_DIR / "node_modules" / ".bin" / "codex"
    if binary.exists():
        return binary
    if shutil.which("npm") is None:
        pytest.skip("the Codex CLI needs node and npm, which this machine does not have")
    CODEX_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(CODEX_DIR),
                    f"@openai/codex@{CODEX_VERSION}"], check=True, capture_output=True, timeout=600)
    return binary


def run_codex(stack, tmp, prompt: str, instructions: str | None) -> subprocess.CompletedProcess:
    home = tmp / "codex-home"
    home.mkdir(exist_ok=True)
    model = client(stack).models.list().data[0].id
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "tandem"\n\n[model_providers.tandem]\nname = "Tandem"\n'
        f'base_url = "{stack.url}/v1"\nwire_api = "responses"\nenv_key = "TANDEM_TEST_KEY"\n')
    args = [str(codex()), "exec", "--skip-git-repo-check", *CODEX_FLAGS]
    if instructions is not None:
        (tmp / "instructions.md").write_text(instructions)
        args += ["-c", f"model_instructions_file={tmp / 'instructions.md'}"]
    env = dict(os.environ, CODEX_HOME=str(home), TANDEM_TEST_KEY="alice")
    # stdin closed: `codex exec` reads "additional input" from a stdin that is not a terminal until EOF
    return subprocess.run([*args, prompt], env=env, cwd=tmp, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300)


def test_codex_cli_unchanged(stack, tmp_path):
    done = run_codex(stack, tmp_path, "Say hi", SHORT_INSTRUCTIONS)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.strip(), done.stderr[-2000:]
    # a request larger than the context: Codex recognises Tandem's context_length_exceeded error
    # (its own words: "ran out of room in the model's context window"), not a 404 or a 500
    big = run_codex(stack, tmp_path, "Say hi", LONG_INSTRUCTIONS)
    out = big.stdout + big.stderr
    assert big.returncode != 0 and "context window" in out, out[-3000:]
    # (a whole word: Codex prints a session id, a UUID such as 01a22c5b-9404-…, which held "404")
    assert not re.search(r"\b404\b", out) and "500 Internal" not in out, out[-3000:]


def test_agents_sdk_with_a_tool_and_an_output_type(stack):
    agents = pytest.importorskip("agents", reason="openai-agents is in the test extras")
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        temperature_c: int

    calls = []

    @agents.function_tool
    def get_temperature(city: str) -> int:
        """The temperature in a city, in degrees Celsius."""
        calls.append(city)
        return 21

    c = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="alice", max_retries=0, timeout=300)
    model = client(stack).models.list().data[0].id
    agent = agents.Agent(name="weather", instructions="Use the tool, then report the weather.",
                         model=agents.OpenAIResponsesModel(model=model, openai_client=c),
                         tools=[get_temperature], output_type=Weather,
                         # greedy, and no repetition penalty (the stack's default for Codex): penalised
                         # digits make this small model write an endless integer
                         model_settings=agents.ModelSettings(temperature=0, tool_choice="required",
                                                             extra_body={"repetition_penalty": 1.0}),
                         tool_use_behavior="run_llm_again", reset_tool_choice=True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4,
                                    run_config=agents.RunConfig(tracing_disabled=True))
    assert isinstance(result.final_output, Weather) and calls
