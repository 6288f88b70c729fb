"""bench.queue_jump against the fake gateway of test_gateway: each round's long chats and its short
one are sent with the asked tier, and their TTFTs come back."""

from __future__ import annotations

import json

from bench import queue_jump
from tests.unit.test_gateway import Server, FakeBackend


def test_queue_jump_sends_each_round_and_reports_ttfts(tmp_path, capsys):
    backend = FakeBackend()
    with Server(backend) as server:
        out = tmp_path / "q.json"
        assert queue_jump.main(["--url", server.url, "--rounds", "2", "--longs", "2", "--long-tokens", "10",
                                "--gap", "0.01", "--tier", "batch", "--short", "Why?", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert len(got["short"]) == 2 and len(got["long"]) == 4 and all(t > 0 for t in got["short"] + got["long"])
    assert len(backend.requests) == 6 and {r.tier for r in backend.requests} == {"batch"}
    assert "short TTFT median" in capsys.readouterr().out
