"""`tandem bench hosts`'s counting of a lost host's streams on the gateway's log lines (the lines
as the N-hosts runs of 2026-11-27 wrote them, ids shortened; the bench itself needs root and
network namespaces)."""

from __future__ import annotations

from bench import hosts

G = "2026-11-27 15:22:33,880 INFO tandem.gateway"


def placed(rid: str, worker: str, how: str = "holds 512 prefix tokens", attempt: int = 0) -> str:
    return (f"{G} [{rid}] {rid}: standard -> cpu-decode {worker} ({how}); decode worker holds 512 prefix tokens, "
            f"no prefill; strategy cpu (standard -> cpu: decode-c holds 664 tokens (23296 free))"
            + (f" (attempt {attempt})" if attempt else "") + "\n")


def start(rid: str) -> str:
    return f"{G} [{rid}] {rid} start model=SmolLM2-135M-Instruct tier=standard session=None prompt=600 stream=True\n"


def resuming(rid: str, why: str = "worker decode-c is gone") -> str:
    return f"{G} [{rid}] {rid}: {why}; resuming at token 4 (seq 4, attempt 1)\n"


def gone(rid: str) -> str:
    return f"{G} [{rid}] {rid}: planned worker decode-c is gone; routing again\n"


def at_kill(log: str, ids: list[str], done: tuple[str, ...] = ()) -> list[dict]:
    """What the client records at the kill: each stream's worker from the log so far."""
    where = hosts.placements(log)
    return [{"id": rid, "worker": where.get(rid, ""), "done": rid in done, "tokens": 2} for rid in ids]


def test_placements_are_the_last_worker_that_took_each_request():
    log = (start("c1") + placed("c1", "decode-c") + placed("c2", "decode-b", "least loaded") + gone("n1")
           + placed("n1", "decode-b") + resuming("c1") + placed("c1", "decode-b", attempt=1)
           + f"{G} [r1] r1: round-robin -> decode-c (turn 0 of 2)\n")
    assert hosts.placements(log) == {"c1": "decode-b", "c2": "decode-b", "n1": "decode-b", "r1": "decode-c"}
    assert hosts.resumes(log) == {"c1": 1}


def test_a_new_request_planned_on_the_lost_host_is_not_one_of_its_streams():
    """Run 1: two of the four streams on decode-c, both resumed on B; the request sent after the
    kill was planned on decode-c too (the routers had not yet missed it). The bench counted 3 on
    C against 2 resumed and failed; only the streams' own ids count."""
    before = "".join(placed(r, w) for r, w in [("s1", "decode-c"), ("s2", "decode-b"), ("s3", "decode-b"),
                                               ("s4", "decode-c")])
    streams = at_kill(before, ["s1", "s2", "s3", "s4"])
    after = (start("n1") + gone("n1") + placed("n1", "decode-b") + resuming("s1") + resuming("s4")
             + placed("s1", "decode-b", attempt=1) + placed("s4", "decode-b", attempt=1))
    got = hosts.lost_streams(streams, after, "decode-c")
    assert got == {"on_lost_host": 2, "resumed": 2, "not_resumed": []}
    assert hosts.streams_resumed(got) is True


def test_no_stream_on_the_lost_host_is_no_check_not_a_failure():
    """Run 3: the routers put all four streams on B; the new request's hand-off to decode-c was
    refused and it resumed (once more a plan naming decode-c). Nothing was lost: the check is not
    made (None), where the bench had failed it."""
    before = "".join(placed(f"s{i}", "decode-b") for i in range(1, 5))
    streams = at_kill(before, ["s1", "s2", "s3", "s4"])
    after = (placed("n1", "decode-c", "least loaded")
             + resuming("n1", "its worker failed: prefill prefill-a: unavailable: hand-off to decode-c failed")
             + gone("n1") + placed("n1", "decode-b", attempt=1))
    got = hosts.lost_streams(streams, after, "decode-c")
    assert got["on_lost_host"] == 0 and hosts.streams_resumed(got) is None


def test_a_stream_on_the_lost_host_not_resumed_fails_the_check():
    before = placed("s1", "decode-c") + placed("s2", "decode-c") + placed("s3", "decode-b")
    streams = at_kill(before, ["s1", "s2", "s3"])
    after = resuming("s1") + placed("s1", "decode-b", attempt=1) + resuming("n1") + resuming("s3")
    got = hosts.lost_streams(streams, after, "decode-c")
    assert got == {"on_lost_host": 2, "resumed": 1, "not_resumed": ["s2"]}
    assert hosts.streams_resumed(got) is False


def test_a_stream_that_ended_before_the_kill_was_not_lost():
    before = placed("s1", "decode-c") + placed("s2", "decode-c")
    streams = at_kill(before, ["s1", "s2"], done=("s2",))
    got = hosts.lost_streams(streams, resuming("s1"), "decode-c")
    assert got == {"on_lost_host": 1, "resumed": 1, "not_resumed": []}


def test_a_resume_before_the_kill_does_not_count():
    """A stream moved onto decode-c by an earlier resume: only a resume after the kill (the log
    from the client's read at the kill) takes it off again."""
    before = placed("s1", "decode-b") + resuming("s1", "worker decode-b is gone") + placed("s1", "decode-c", attempt=1)
    streams = at_kill(before, ["s1"])
    assert streams[0]["worker"] == "decode-c"
    assert hosts.streams_resumed(hosts.lost_streams(streams, "", "decode-c")) is False
