"""The KV pool through the whole stack: `tandem up` with a kvpool service, the official openai
client over HTTP. A long prompt's chunks are written back to the pool's disk tier (or its Redis
tier, with no disk tier); after a restart of the whole stack (the workers' own prefix caches and
the pool's RAM tier are gone) the same prompt reuses them — its chunks and its tail: every prompt
token but the last is cached — and gives the same greedy output."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import openai
import pytest

from tests.e2e.test_stack import bus_denials, planned_workers, start_stack

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


class DirPool:
    """The pool's disk tier in a directory."""

    def __init__(self, root: str):
        self.root = root
        self.env = {"TANDEM_POOL_DIR": root}

    def entries(self) -> int:
        return sum(f.endswith(".kvp") for _, _, fs in os.walk(self.root) for f in fs)

    def close(self) -> None:
        pass


class RedisPool:
    """The pool's Redis tier only (no disk tier), under a key prefix of its own."""

    def __init__(self):
        from tests.integration.test_pool_tiers import REDIS_URL, RedisStore
        self.store = RedisStore(None)
        self.env = {"TANDEM_POOL_DIR": "", "TANDEM_POOL_REDIS_URL": REDIS_URL,
                    "TANDEM_POOL_REDIS_PREFIX": self.store.prefix}

    def entries(self) -> int:
        return self.store.count()

    def close(self) -> None:
        self.store.close()


def run_stack(nats_server, pool, fn, args=("--gpu-decode", "0"), stop=None):
    """Run ``fn(client)`` against a fresh stack on ``pool`` (a DirPool / RedisPool), then stop it:
    SIGTERM to `tandem up`, after ``stop(server)`` when given. Returns (fn's result, the stack's
    pool log lines)."""
    env = dict(pool.env, TANDEM_POOL_TIMEOUT="60")  # a loaded CI machine is slow
    s = start_stack(nats_server, args, env)
    try:
        s.wait_workers(planned_workers(args), 300)
        out = fn(openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0))
        if stop is not None:
            stop(s)
    finally:
        rc = s.stop()
    assert rc == (-signal.SIGKILL if stop is kill_up else 0), s.tail()
    assert not bus_denials(s)
    return out, [line for line in s.tail(400).splitlines() if "pool" in line.lower()]


@pytest.fixture
def dir_pool(tmp_path):
    return DirPool(str(tmp_path / "pool"))


@pytest.fixture(params=["disk", "redis"])
def pool(request, tmp_path):
    p = DirPool(str(tmp_path / "pool")) if request.param == "disk" else RedisPool()
    try:
        yield p
    finally:
        p.close()


@pytest.mark.slow  # two stack start-ups and two long prefills: minutes on a loaded 2-core machine
def test_second_request_reuses_pool_prefix_after_restart(nats_server, pool):
    def cold(client):
        r = chat(client)
        deadline = time.monotonic() + 60
        while pool.entries() < 4 and time.monotonic() < deadline:  # write-back is in the background
            time.sleep(0.2)
        return r

    first, _ = run_stack(nats_server, pool, cold)
    assert first.usage.prompt_tokens >= 1100, first.usage
    assert pool.entries() >= 4, "the prompt's chunks were not written back to the pool"
    assert first.usage.prompt_tokens_details.cached_tokens < 1024

    second, log = run_stack(nats_server, pool, chat)  # a fresh stack: only the pool remembers
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    # the chunks and the prompt's tail: all but the last token (always computed) came from the pool
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1, "\n".join(log)
    assert second.choices[0].message.content == first.choices[0].message.content


def copies(s) -> list[int]:
    """Process ids of the service copies `tandem up` runs."""
    return [int(p) for p in subprocess.run(["pgrep", "-P", str(s.proc.pid)], capture_output=True,
                                           text=True).stdout.split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def sigterm_every_process(s) -> None:
    """SIGTERM to `tandem up` and every service copy at once, as systemd's default stop
    (KillMode=control-group) sends it: the pool gets it together with the workers."""
    for pid in [s.proc.pid, *copies(s)]:
        os.kill(pid, signal.SIGTERM)


def kill_up(s) -> None:
    """kill -9 of `tandem up`: its copies get SIGTERM from the kernel (PR_SET_PDEATHSIG), all at
    once, and outlive it while they drain: wait until the last one exited."""
    pids = copies(s)
    os.kill(s.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(alive, pids)), "service copies still running 120 s after kill -9 of tandem up"


@pytest.mark.parametrize("stop", [  # each: two stack start-ups and two prefills of 1.2K tokens, ~20 s
    pytest.param(None, id="sigterm-up", marks=pytest.mark.slow),
    pytest.param(sigterm_every_process, id="sigterm-every-process"),  # the one that lost it: default run
    pytest.param(kill_up, id="kill-9-up", marks=pytest.mark.slow)])
def test_write_back_pending_at_shutdown_is_kept(nats_server, dir_pool, stop):
    """The stack stopped the moment the reply came, while the write-back of the prompt's chunks
    was still pending (a colocated worker writes back when the request finishes): the worker
    drains it into the pool, which takes it before exiting; the next stack reuses it."""
    args = ("--prefill", "0", "--gpu-decode", "0")
    first, log = run_stack(nats_server, dir_pool, chat, args, stop)
    assert first.usage.prompt_tokens >= 1100, first.usage
    assert dir_pool.entries() >= 4, "the pending write-back was dropped at shutdown:\n" + "\n".join(log)

    second, log = run_stack(nats_server, dir_pool, chat, args)
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1, "\n".join(log)
    assert second.choices[0].message.content == first.choices[0].message.content
