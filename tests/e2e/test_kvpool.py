"""The KV pool through the whole stack: `tandem up` with a kvpool service, the official openai
client over HTTP. A long prompt's chunks are written back to the pool's disk tier; after a
restart of the whole stack (the workers' own prefix caches are gone) the same prompt reuses
them: >= 1,024 cached prompt tokens and the same greedy output."""

from __future__ import annotations

import os
import time

import openai
import pytest

from tests.e2e.test_stack import running_stack

SYSTEM = ("You are a careful assistant for a shipping company. Rules: answer briefly; cite the "
          "manifest line you used; never invent a port. Manifest: ") + " ".join(
    f"line {i}: container C{i:04d} carries {['wool', 'salt', 'tea', 'iron', 'glass'][i % 5]} "
    f"from port P{i % 7} to port P{(i * 3) % 11}." for i in range(52))
QUESTION = "Which container carries tea from port P2?"


def chat(client: openai.OpenAI):
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])


def run_stack(nats_server, pool_dir: str, fn):
    """Run ``fn(client)`` against a fresh stack; returns (its result, the pool's log lines)."""
    env = {"TANDEM_POOL_DIR": pool_dir, "TANDEM_POOL_TIMEOUT": "60"}  # a loaded CI machine is slow
    with running_stack(nats_server, ["--gpu-decode", "0"], env=env, timeout=300) as s:
        return fn(openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)), \
            [line for line in s.tail(400).splitlines() if "pool" in line.lower()]


def entries(pool_dir: str) -> int:
    return sum(f.endswith(".kvp") for _, _, fs in os.walk(pool_dir) for f in fs)


@pytest.mark.slow  # two stack start-ups and two long prefills: minutes on a loaded 2-core machine
def test_second_request_reuses_pool_prefix_after_restart(nats_server, tmp_path):
    pool_dir = str(tmp_path / "pool")

    def cold(client):
        r = chat(client)
        deadline = time.monotonic() + 60
        while entries(pool_dir) < 4 and time.monotonic() < deadline:  # write-back is in the background
            time.sleep(0.2)
        return r

    first, _ = run_stack(nats_server, pool_dir, cold)
    assert first.usage.prompt_tokens >= 1100, first.usage
    assert entries(pool_dir) >= 4, "the prompt's chunks were not written back to the pool"
    assert first.usage.prompt_tokens_details.cached_tokens < 1024

    second, log = run_stack(nats_server, pool_dir, chat)  # a fresh stack: only the pool remembers
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= 1024, "\n".join(log)
    assert second.choices[0].message.content == first.choices[0].message.content
