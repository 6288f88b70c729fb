"""The gateway's limits (services/gateway/limits.py) over a real uvicorn server and a fake
backend: body size with chunked uploads, streams per API key (and their release), large inputs
tokenized off the event loop, and every error in OpenAI's shape with a code."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import openai
import pytest

from services.gateway.app import GatewaySettings
from tests.unit.test_gateway import MODEL, MSGS, FakeBackend, FakeTokenizer, Server, wait_for

LIMIT = 64 << 10
KEYS = {"alice": {"Authorization": "Bearer alice"}, "bob": {"Authorization": "Bearer bob"}}


class GatedTokenizer(FakeTokenizer):
    """Blocks in ``encode`` on a long text until the test opens the gate."""

    def __init__(self):
        self.entered = threading.Event()   # a long text is being tokenized
        self.gate = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 20000:
            self.entered.set()
            self.gate.wait(60)
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def limited():
    backend = FakeBackend()
    backend.tokenizer = GatedTokenizer()
    settings = GatewaySettings(max_body_bytes=LIMIT, max_streams_per_key=2, tokenize_threads=1,
                               api_keys="alice=standard,bob=standard")
    with Server(backend, settings) as server:
        yield server, backend


@pytest.fixture
def served(limited):
    server, backend = limited
    backend.reset()
    yield server.url, backend, server.app.state.gw
    backend.hang_after = None
    assert wait_for(lambda: server.app.state.gw.streams.in_flight() == 0), server.app.state.gw.streams.held  # no leak


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": MSGS, **kw}


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"], err
    return err


# ---- body size ----------------------------------------------------------------------------------

def test_a_chunked_body_over_the_limit_is_413(served):
    url, backend, _ = served
    sent = 0

    def body():  # no Content-Length: Transfer-Encoding chunked, 64 MiB if it were all read
        nonlocal sent
        for _ in range(1024):
            sent += 65536
            yield b"x" * 65536

    r = httpx.post(f"{url}/v1/chat/completions", content=body(), headers={**KEYS["alice"]}, timeout=30)
    err = _error(r, 413, "body_too_large")
    assert err["type"] == "invalid_request_error" and r.headers["connection"] == "close"
    assert sent < 1024 * 65536   # the connection closed: the rest of the upload was never read
    assert backend.requests == []
    still_serving_keyed(url)


def test_a_declared_length_over_the_limit_is_413_before_the_body(served):
    url, backend, _ = served
    body = b'{"model": "' + b"m" * LIMIT + b'"}'
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        r = httpx.post(f"{url}{path}", content=body, headers={**KEYS["bob"], "Content-Type": "application/json"})
        _error(r, 413, "body_too_large")
    assert backend.requests == []


def still_serving_keyed(url: str) -> None:
    r = httpx.get(f"{url}/v1/models", headers=KEYS["alice"], timeout=5)
    assert r.status_code == 200, r.text


# ---- streams per key ----------------------------------------------------------------------------

def test_streams_per_key_are_capped_and_released(served):
    url, backend, gw = served
    backend.hang_after = 2   # streams stay open until their clients go
    with httpx.Client(timeout=10) as http:
        streams = []
        for _ in range(2):
            s = http.stream("POST", f"{url}/v1/chat/completions", json=_chat(stream=True), headers=KEYS["alice"])
            r = s.__enter__()
            assert r.status_code == 200
            streams.append(s)
        assert gw.streams.held == {next(iter(gw.streams.held)): 2}
        r = httpx.post(f"{url}/v1/chat/completions", json=_chat(), headers=KEYS["alice"], timeout=10)
        err = _error(r, 429, "too_many_streams")
        assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "p", "max_tokens": 1},
                       headers=KEYS["bob"], timeout=10)   # another key is not affected
        assert r.status_code == 200, r.text
        streams.pop().__exit__(None, None, None)   # a client goes away: its hold is released
        assert wait_for(lambda: gw.streams.in_flight() == 1), gw.streams.held
        backend.hang_after = None
        r = httpx.post(f"{url}/v1/chat/completions", json=_chat(), headers=KEYS["alice"], timeout=10)
        assert r.status_code == 200, r.text
        streams.pop().__exit__(None, None, None)
    assert wait_for(lambda: gw.streams.in_flight() == 0), gw.streams.held


def test_errors_and_finished_streams_release_their_hold(served):
    url, backend, gw = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="alice", max_retries=0, timeout=10)
    for _ in range(3):   # more than the cap, one after another
        list(client.chat.completions.create(model=MODEL, messages=MSGS, stream=True))
        client.completions.create(model=MODEL, prompt="p", max_tokens=2)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=MSGS, temperature=-1)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="other", messages=MSGS, stream=True)
    assert gw.streams.in_flight() == 0


# ---- tokenization off the event loop ------------------------------------------------------------

def test_a_large_input_is_tokenized_while_other_streams_flow(served):
    url, backend, _ = served
    tok = backend.tokenizer
    tok.entered.clear()
    tok.gate.clear()
    big: list[httpx.Response] = []
    t = threading.Thread(target=lambda: big.append(httpx.post(
        f"{url}/v1/chat/completions", json=_chat(messages=[{"role": "user", "content": "y" * 30000}]),
        headers=KEYS["bob"], timeout=60)))
    t.start()
    try:
        assert tok.entered.wait(30), "the large input never reached the tokenizer"
        # the large input is inside the tokenizer now; a stream from another client is served meanwhile
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="alice", max_retries=0, timeout=20)
        chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, stream=True))
        assert chunks[-1].usage.completion_tokens > 0
        assert not big and t.is_alive()   # ... while the large one was still being tokenized
    finally:
        tok.gate.set()
        t.join(60)
    _error(big[0], 400, "context_length_exceeded")   # tokenized, then found too long for the context


# ---- errors in OpenAI's shape -------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_an_unexpected_exception_is_a_500_with_a_code(served, stream):
    url, backend, _ = served
    backend.error = RuntimeError("a bug")
    with httpx.Client(timeout=10) as http:   # one keep-alive connection for both requests
        r = http.post(f"{url}/v1/chat/completions", json=_chat(stream=stream), headers=KEYS["alice"])
        err = _error(r, 500, "internal_error")
        assert err["type"] == "server_error" and "RuntimeError" in err["message"] and r.headers["x-request-id"]
        backend.error = None
        # the connection stays open: the client's next request on it is answered, not reset
        assert http.post(f"{url}/v1/chat/completions", json=_chat(), headers=KEYS["alice"]).status_code == 200
    still_serving_keyed(url)


def test_a_client_gone_while_its_body_is_read_is_not_an_error(served, caplog):
    url, backend, gw = served
    caplog.set_level(logging.INFO, logger="tandem.gateway")
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        time.sleep(0.3)                                        # the handler is reading the body
        assert gw.streams.in_flight() == 0                     # an upload holds no stream slot
    assert wait_for(lambda: "client disconnected before its request was read" in caplog.text), caplog.text
    assert "internal error" not in caplog.text and backend.requests == []


def test_the_requests_in_flight_are_a_gauge_that_returns_to_zero(served):
    """`tandem_gateway_requests_in_flight`: what an operator reads to see nothing was left behind
    by clients that left (before, only the workers' gauges, on ports found in the log)."""
    url, backend, gw = served
    backend.endless = True

    def gauge() -> float:
        text = httpx.get(f"{url}/metrics").text
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("tandem_gateway_requests_in_flight ")))
    base = gauge()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_chat(stream=True),
                      headers={"Authorization": "Bearer alice"}, timeout=30) as r:
        lines = r.iter_lines()      # (kept: a dropped line iterator closes the response)
        next(lines)
        assert wait_for(lambda: gauge() == base + 1)
    assert wait_for(lambda: gauge() == base)
    backend.endless = False


def test_a_stream_still_going_when_the_drain_time_runs_out_ends_with_an_error_event():
    """At shutdown in-flight streams get ``drain_s``; one still going then ends with an SSE error
    event (code ``unavailable``: send it again), not a cut connection without an error or
    ``[DONE]``."""
    backend = FakeBackend()
    backend.endless = True
    with draining(backend) as (server, settings):
        lines, got_data = [], threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"http://127.0.0.1:{settings.port}/v1/chat/completions",
                              json=_chat(stream=True), timeout=30) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    got_data.set()
        client = threading.Thread(target=stream)
        client.start()
        assert got_data.wait(10)
        t0 = time.monotonic()
        server.should_exit = True                      # what SIGTERM does
        client.join(30)
        assert not client.is_alive() and time.monotonic() - t0 < 1.0 + 3.0 + 2.0
        data = [line for line in lines if line.startswith("data: ")]
        assert '"code":"unavailable"' in data[-1] and "shutting down" in data[-1] and "data: [DONE]" not in data


@contextlib.contextmanager
def draining(backend, drain_s: float = 1.0):
    """A gateway served as `tandem serve gateway` serves it (draining at shutdown), in a thread;
    stopped after."""
    from services.gateway.app import create_app, draining_server
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    settings = GatewaySettings(drain_s=drain_s, port=sock.getsockname()[1])
    server = draining_server(create_app(backend, settings), settings, log_level="warning")
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: server.started, 10)
        yield server, settings
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


class _Stalling(FakeBackend):
    """A backend that says nothing more: before the first output where the prompt says "silent"
    (a request still in its prefill), after 3 outputs else (a bus gone mid-stream)."""

    async def generate(self, req):
        silent = b"silent" in bytes(t for t in req.prompt_token_ids if t < 256)
        n = 0
        async for out in super().generate(req):
            if silent or n == 3:
                await asyncio.sleep(3600)
            n += 1
            yield out


def test_requests_waiting_on_their_backend_when_the_drain_time_runs_out_end_with_unavailable():
    """A request with no output on its way when the drain ends (still in its prefill, or its
    backend silent: the bus stopped with the stack) is woken then: a stream ends with the error
    event, a request not yet answered gets a 503 — not a connection cut by uvicorn 3 s later
    with no answer, or a body cut without an error."""
    backend = _Stalling()
    got: dict[str, object] = {}
    with draining(backend) as (server, settings):
        url = f"http://127.0.0.1:{settings.port}/v1/chat/completions"

        def stalled_stream() -> None:
            with httpx.stream("POST", url, json=_chat(stream=True), timeout=30) as r:
                got["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        def post(name: str, body: dict) -> None:
            try:
                got[name] = httpx.post(url, json=body, timeout=30)
            except httpx.HTTPError as e:
                got[name] = e
        silent = [{"role": "user", "content": "silent"}]
        clients = [threading.Thread(target=stalled_stream),
                   threading.Thread(target=post, args=("prefill", _chat(messages=silent, stream=True))),
                   threading.Thread(target=post, args=("collect", _chat(n=2)))]   # two choices waiting
        for c in clients:
            c.start()
        assert wait_for(lambda: len(backend.requests) == 4, 10)
        time.sleep(0.3)
        t0 = time.monotonic()
        server.should_exit = True                      # what SIGTERM does
        for c in clients:
            c.join(30)
        assert time.monotonic() - t0 < 1.0 + 2.0       # at the drain's end, not uvicorn's 3 s later
        data = got["stream"]
        assert len(data) > 3 and '"code":"unavailable"' in data[-1] and "data: [DONE]" not in data
        for name in ("prefill", "collect"):
            r = got[name]
            assert isinstance(r, httpx.Response) and r.status_code == 503, (name, r)
            assert r.json()["error"]["code"] == "unavailable"
        assert wait_for(lambda: len(set(backend.aborted)) == 4, 5), backend.aborted


# ---- a client that stops reading ----------------------------------------------------------------

def test_a_client_that_stops_reading_gives_its_stream_slot_back():
    """A streamed request whose client never reads (a full receive window, connection kept open):
    its stream slot and its unsent output were held for as long as the connection lasted — one
    client locked every other client of its key out with 429 (the HTTP probe: 8 of 8 slots for
    7 minutes). After TANDEM_WRITE_TIMEOUT_S without the client reading, the request is aborted,
    its slot freed and the connection closed."""
    backend = FakeBackend()
    backend.endless, backend.endless_text = True, "x" * 8192   # 4 MB/s: the buffers fill in a second
    with Server(backend, GatewaySettings(max_streams_per_key=1, write_timeout_s=1.0)) as server:
        gw = server.app.state.gw
        host, port = server.url.removeprefix("http://").split(":")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.connect((host, int(port)))
        body = json.dumps(_chat(stream=True)).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            assert wait_for(lambda: gw.streams.in_flight() == 1, 10)
            assert wait_for(lambda: backend.aborted, 30), "the unread stream was never given up"
            assert wait_for(lambda: gw.streams.in_flight() == 0, 5), gw.streams.held
            backend.endless = False
            r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(), timeout=10)
            assert r.status_code == 200, r.text           # the key's one slot is free again
        finally:
            s.close()


# ---- read deadlines ---------------------------------------------------------------------------

READ_S = 1.0


@pytest.fixture(scope="module")
def deadlined():
    """Keyless (one tenant for every client), 2 streams at most, 1 s to send a request."""
    backend = FakeBackend()
    settings = GatewaySettings(max_streams_per_key=2, read_timeout_s=READ_S)
    with Server(backend, settings) as server:
        yield server.url, backend, server.app.state.gw


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _partial_body(url: str) -> socket.socket:
    s = _connect(url)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 200\r\n\r\n{\"model\": ")
    return s


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(closed by the server within ``seconds``, what it sent before)."""
    s.settimeout(seconds)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
        return True, got
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got


def test_stalled_uploads_hold_no_stream_slot_and_end_with_408(deadlined):
    """256 connections that never finished their body took every slot of the keyless tenant (the
    cap counted them from the headers) and were held for good: 429 for every client, forever."""
    url, backend, gw = deadlined
    stalled = [_partial_body(url) for _ in range(3)]      # more than the 2 slots
    try:
        time.sleep(0.2)
        r = httpx.post(f"{url}/v1/chat/completions", json=_chat(), timeout=10)
        assert r.status_code == 200, r.text               # the slots are free for real requests
        t0 = time.monotonic()
        for s in stalled:
            closed, got = _closed_within(s, 5 * READ_S)
            assert closed and got.startswith(b"HTTP/1.1 408 "), got[:200]
            assert b'"code":"request_timeout"' in got and b"connection: close" in got.lower()
        assert time.monotonic() - t0 < 3 * READ_S
    finally:
        for s in stalled:
            s.close()
    assert gw.streams.in_flight() == 0 and len(backend.requests) == 1


@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_without_a_whole_request_is_closed(deadlined, sent):
    """Connected and silent, or headers that never end (slowloris): uvicorn's keep-alive timer
    runs only after a response, so both were held for good."""
    url, _, _ = deadlined
    with _connect(url) as s:
        s.sendall(sent)
        closed, got = _closed_within(s, 4 * READ_S)
        assert closed and got == b""


def test_a_long_stream_and_a_kept_alive_connection_are_not_cut(deadlined):
    """The deadlines bound reading a request, not answering it, nor a client's next request
    sent soon after its last one."""
    url, backend, _ = deadlined
    backend.endless = True
    try:
        with httpx.Client(timeout=10) as http:
            with http.stream("POST", f"{url}/v1/completions",
                             json={"model": MODEL, "prompt": "p", "stream": True, "max_tokens": 200}) as r:
                t0, lines = time.monotonic(), 0
                for line in r.iter_lines():
                    lines += bool(line)
                    if time.monotonic() - t0 > 3 * READ_S:
                        break
            assert lines > 100
            backend.endless = False
            for _ in range(3):
                time.sleep(READ_S / 2)
                assert http.post(f"{url}/v1/chat/completions", json=_chat()).status_code == 200
    finally:
        backend.endless = False


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_encoded():
    """A 6 MiB message under the body limit (32 MiB) for an 8K context: the gateway encoded it —
    seconds of CPU and ~50x its size in memory a request (30 MiB: 2-3 minutes, 2 GiB) — for a
    400 certain from its length. Now refused from the length alone; the answer is the same 400."""
    from shared.engine.model_files import load_tokenizer
    tok, cfg = load_tokenizer()
    encoded: list[int] = []

    class Counting(type(tok)):
        def encode(self, text, add_special_tokens=True):
            encoded.append(len(text))
            return super().encode(text, add_special_tokens)

    tok.__class__ = Counting
    backend = FakeBackend()
    backend.tokenizer, backend.max_context = tok, cfg.max_context
    with Server(backend, GatewaySettings()) as server:
        big = "hello world " * (6 << 17)                          # 6 MiB
        for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": big}]}),
                           ("/v1/completions", {"model": MODEL, "prompt": big})):
            t0 = time.monotonic()
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            err = _error(r, 400, "context_length_exceeded")
            assert "at least" in err["message"] and err["param"] in ("messages", "prompt")
            assert time.monotonic() - t0 < 10
        assert max(encoded, default=0) < 1 << 20 and backend.requests == []
        r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200, r.text                     # a prompt that fits is encoded as before
        assert encoded


@pytest.mark.parametrize("raw", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",   # chunk size
    b"GET /v1/models\r\n\r\n",                                                                   # HTTP/0.9
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",           # headers
])
def test_a_request_the_http_parser_refuses_gets_an_openai_shaped_400(served, raw):
    """Framing the HTTP layer itself refuses: a 400 in OpenAI's error shape (uvicorn's own was
    plain text, "Invalid HTTP request received."), and the connection closed."""
    url, backend, _ = served
    with _connect(url) as s:
        s.sendall(raw)
        closed, got = _closed_within(s, 5)
    assert closed and got.startswith(b"HTTP/1.1 400 ") and b"application/json" in got, got[:300]
    body = json.loads(got.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "invalid_request" and body["error"]["type"] == "invalid_request_error", body
    assert backend.requests == []


def test_both_framings_are_refused_and_the_connection_closed(served):
    """Content-Length and Transfer-Encoding together (the request-smuggling vector when a proxy in
    front reads the other) was taken with the chunked body: RFC 9112 §6.1 says error and close."""
    url, backend, _ = served
    with _connect(url) as s:
        body = b'{"model": "m"}'
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                  + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
        closed, got = _closed_within(s, 5)
    assert closed and got.startswith(b"HTTP/1.1 400 ") and b'"code":"invalid_request"' in got, got[:300]
    assert backend.requests == []
