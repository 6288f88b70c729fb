"""`python -m bench.gpu_host --stack` (bench/gpu_host.py): a real stack (`tandem up`, its own NATS,
the gateway over HTTP, the `openai` client) whose gpu-decode worker decodes on a modeled device
(bench/modeled_site) — what the stack adds to a token when its engine is that fast."""

from __future__ import annotations

from bench.gpu_host import stack_tpot


def test_the_stack_streams_at_the_modeled_device_s_pace():
    """At 30 ms a step every token of the stream takes at least that long: the worker decodes on
    the modeled device, not on its CPU engine (which decodes this model several times faster:
    a worker left unmodeled fails this)."""
    got = stack_tpot(30_000, requests=1, max_tokens=12)
    assert got["ok"] == 1 and got["errors"] == 0
    assert 30 <= got["tpot_p50_ms"] < 60
