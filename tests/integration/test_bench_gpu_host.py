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


def test_the_host_share_of_drawn_rows_is_measured_with_the_graph_drawing_them():
    """`--sampled`: rows at temperature 0.8 / top-p 0.95 go through the stub graph as a GPU's
    would (``sampler.on_device``: the graph draws them), so the figure is the host's bookkeeping of
    drawn rows — each takes the stub's token, not a host draw from the stub's zero logits."""
    import torch

    from bench.gpu_host import TEXT, StubGraphs, _decode_steps
    from shared.engine.engine import Engine, EngineConfig
    e = Engine.from_path(None, EngineConfig(threads=1, enable_prefix_caching=False, max_num_seqs=4,
                                            num_kv_blocks=64))
    text = e.tokenizer.encode(TEXT, add_special_tokens=False)
    e.graphs = StubGraphs(4, 512, e.layout.block_size, e.model.cfg.vocab_size, text)
    drawn = []
    take = e.graphs._body

    def body(bucket, variant=None):
        drawn.append(variant)
        return take(bucket, variant)
    e.graphs._body = body
    outs = {}
    orig = e.step

    def step():
        got = orig()
        for o in got:
            outs.setdefault(o.request_id, []).extend(o.token_ids)
        return got
    e.step = step
    assert _decode_steps(e, 3, 8, temperature=0.8, top_p=0.95) > 0
    assert drawn and all(v is True for v in drawn[1:])      # the filtered variant: top-p in every step
    # after the first (the prefill's, drawn on the host from real logits) every token is one of the
    # stub's (a host draw from its zero logits: any of 49,152 tokens, ~0.2 % of them the text's)
    assert sorted(map(len, outs.values())) == [16, 16, 16]      # max_tokens: steps + 8
    assert all(t in set(text) for toks in outs.values() for t in toks[1:])
    assert torch.count_nonzero(e.graphs.logits) == 0
