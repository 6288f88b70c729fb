"""A client that goes away aborts its request: mid-stream, while tokens flow, before the first
output, non-streaming; a finished request is never aborted. Over a real server with the fake
backend of tests/unit/test_gateway.py (whose fixtures these share)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from shared import metrics
from tests.unit.test_gateway import (  # noqa: F401  (fixtures: served, backend, url, client)
    MODEL, MSGS, _chat, backend, client, served, still_serving, url, wait_for,
)


# ---- client disconnect -> abort ----------------------------------------------------------------

def aborted() -> float:
    """The gateway's count of requests its clients left (it counted none: docs promise `aborted`)."""
    return sum(metrics.REQUESTS.labels("gateway", t, "aborted")._value.get()
               for t in ("interactive", "standard", "batch"))


def test_disconnect_mid_stream_aborts(url, backend):
    backend.hang_after = 2
    before = aborted()
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{url}/v1/chat/completions", json=_chat(stream=True)) as r:
            rid = r.headers["x-request-id"]
            seen = []
            for line in r.iter_lines():
                if line:
                    seen.append(line)
                if len(seen) == 3:  # role chunk, "H", "e"; then the backend hangs
                    break
            assert '"H"' in seen[1] and '"e"' in seen[2]
    assert wait_for(lambda: backend.aborted == [rid]), backend.aborted
    assert [q.request_id for q in backend.requests] == [rid]
    assert wait_for(lambda: aborted() == before + 1)
    still_serving(url)


def test_disconnect_while_tokens_flow_aborts(url, backend):
    backend.endless = True
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{url}/v1/completions",
                         json={"model": MODEL, "prompt": "p", "stream": True, "max_tokens": 200}) as r:
            rid = r.headers["x-request-id"]
            for i, _ in enumerate(r.iter_lines()):
                if i == 20:
                    break
    assert wait_for(lambda: backend.aborted == [rid]), backend.aborted
    still_serving(url)


def _raw_request(url: str, body: dict) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_before_first_output_aborts(url, backend, stream):
    backend.hang_after = 0
    before = aborted()
    s = _raw_request(url, _chat(stream=stream))
    assert wait_for(lambda: len(backend.requests) == 1)
    s.close()
    rid = backend.requests[0].request_id
    assert wait_for(lambda: backend.aborted == [rid]), backend.aborted
    assert wait_for(lambda: aborted() == before + 1)
    still_serving(url)


def test_disconnect_non_streaming_mid_generation_aborts(url, backend):
    backend.hang_after = 5
    before = aborted()
    s = _raw_request(url, _chat())
    assert wait_for(lambda: len(backend.requests) == 1)
    time.sleep(0.1)
    s.close()
    assert wait_for(lambda: backend.aborted == [backend.requests[0].request_id]), backend.aborted
    assert wait_for(lambda: aborted() == before + 1)
    still_serving(url)


def test_finished_requests_are_not_aborted(client, backend):
    before = aborted()
    client.chat.completions.create(model=MODEL, messages=MSGS)
    list(client.chat.completions.create(model=MODEL, messages=MSGS, stream=True))
    time.sleep(0.1)
    assert len(backend.requests) == 2 and backend.aborted == [] and aborted() == before


async def test_one_abort_goes_out_per_request():
    """The HTTP layer aborts a request whose client left, and closing its backend stream aborts it
    again: the NATS backend broadcasts the Abort once (every worker got two)."""
    from services.gateway.nats_backend import NatsBackend

    class Bus:
        def __init__(self):
            self.sent = []

        async def publish(self, subject, msg):
            self.sent.append((subject, msg.request_id))

    bus = Bus()
    gateway = NatsBackend(bus, "m", 1024, tokenizer=None)
    for rid in ("r1", "r1", "r2", "r1"):
        await gateway.abort(rid)
    assert [rid for _, rid in bus.sent] == ["r1", "r2"]
