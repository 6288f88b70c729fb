"""Our logits against Hugging Face ``transformers`` (fp32) on the *same* Q4_0 weights.

The bundled model is written once to an all-Q4_0 GGUF (``shared.engine.quantize``); both our
engine and ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` load that file, so the
comparison measures our numerics (Q8_0 activations in the CPU kernel, fp16 KV cache, our rope
and attention), not quantization. A fixed English text of >= 512 tokens runs as one prefill
through both; every position's logits are compared. And the weights ``transformers`` read from
that file are ours exactly (the file's interop, Q/K row permutation included).

    pytest tests/integration/test_hf_parity.py -s     # prints the measured figures

Figures are recorded in docs/benchmarks.md ("Numerics"); the bounds below sit a little above them.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels import q4_0
from shared.engine import quantize
from shared.engine.engine import Engine, EngineConfig
from shared.engine.loader import LoadedModel, load_model
from shared.engine.model_files import bundled_model_path

transformers = pytest.importorskip("transformers")

N_TOKENS = 512  # the first 512 tokens of TEXT (it has ~600): keeps the test near a minute on 2 cores
DECISIVE = 0.5  # a position is "decisive" when HF's top-1 logit leads its top-2 by at least this

# Bounds per kernel path: (min top-1 agreement, min top-1 agreement on decisive positions,
# max |dlogit|, mean |dlogit|). Measured figures are in docs/benchmarks.md ("Numerics").
# The issue asks for top-1 >= 99 %: the engine's default CPU path (packed weights, int16
# activations), the kernel with f32 activations and the torch reference meet it. The opt-in Q8_0 activations (llama.cpp's
# scheme, TANDEM_CPU_ACT=q8) flip near-ties (HF margin < 0.3 logit) on ~2-4 % of positions of
# this text, so its overall bound is lower and the 99 % is asserted on decisive positions.
BOUNDS = {
    "auto": (0.99, 0.99, 0.10, 0.004),     # the default: CPU kernel, q16 (int16 activations)
    "auto-f32": (0.99, 0.99, 0.10, 0.004),  # CPU kernel, f32 activations (TANDEM_CPU_ACT=f32)
    "auto-q8": (0.95, 0.99, 5.0, 0.20),    # CPU kernel, Q8_0 activations (TANDEM_CPU_ACT=q8)
    "reference": (0.99, 0.99, 0.10, 0.004),
}

TEXT = """\
The Hanseatic League was a commercial and defensive confederation of merchant guilds and market \
towns in Central and Northern Europe. Growing from a few North German towns in the late twelfth \
century, the league came to dominate Baltic maritime trade for three centuries along the coasts of \
Northern Europe. It stretched from the Baltic to the North Sea and inland during the Late Middle \
Ages, and it declined slowly after about 1450.

Lübeck, founded in 1159, became the principal city of the league. Its merchants traded furs, wax, \
timber and grain from the east for cloth, salt, wine and metal goods from the west. Herring caught \
off the coast of Scania was salted with salt brought from Lüneburg and shipped across the continent, \
for the Church required that fish be eaten on many days of the year. The cog, a broad and sturdy \
ship with a single mast and a square sail, carried these cargoes between the ports.

The league had no permanent army, no common treasury and no single government. Its members met in \
an assembly called the Diet, which gathered irregularly in Lübeck and passed resolutions that the \
towns were expected, but not always willing, to obey. When a ruler threatened its privileges, the \
league could impose a trade embargo, and on a few occasions it went to war. In 1370 the Treaty of \
Stralsund, which ended a war with the King of Denmark, gave the towns control of fortresses on the \
Scanian coast and a voice in the choice of the next Danish king.

Abroad, the merchants lived in trading posts called kontors. The largest were in London, Bruges, \
Bergen and Novgorod. In London the Steelyard, a walled compound on the bank of the Thames, held \
warehouses, a weighing house, a chapel and living quarters, and its residents were bound by strict \
rules: they were forbidden to marry local women and had to be inside the gates by nightfall. In \
Bergen the German merchants controlled the export of dried cod from the north of Norway.

Several forces brought the league to an end. The rise of strong territorial states in Scandinavia, \
Poland and Russia limited its privileges, and the Dutch, with larger ships and better financing, \
took over much of the Baltic trade. The discovery of sea routes to the Americas and Asia moved the \
centre of European commerce to the Atlantic. Novgorod was closed to the Germans in 1494, and the \
Steelyard lost its privileges in 1598. The last formal Diet met in 1669, attended by only a handful \
of towns. Yet the memory of the league survived: Hamburg, Bremen and Lübeck still call themselves \
Hanseatic cities, and the letters HH on the number plates of Hamburg cars stand for Hansestadt Hamburg.
"""


@pytest.fixture(scope="module")
def q4_0_gguf(tmp_path_factory, bundled_model: LoadedModel) -> str:
    """The bundled model as an all-Q4_0 GGUF, written once for this module.

    ``quantize_model`` loads its source itself (~10 s of Q4_1 -> Q4_0 conversion); the session's
    already-loaded bundled model is handed to it instead, which is the same call's result.
    """
    path = str(tmp_path_factory.mktemp("hf_parity") / "smollm2-135m-q4_0.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quantize, "load_model", lambda src, progress=False: bundled_model)
        quantize.quantize_model(bundled_model_path(), path)
    return path


@pytest.fixture(scope="module")
def q4_model(q4_0_gguf) -> LoadedModel:
    return load_model(q4_0_gguf)


@pytest.fixture(scope="module")
def ids(q4_model) -> list[int]:
    out = q4_model.tokenizer.encode(TEXT)
    assert len(out) >= N_TOKENS, f"the fixed text is only {len(out)} tokens"
    return out[:N_TOKENS]


@pytest.fixture(scope="module")
def hf_model(q4_0_gguf):
    """``transformers`` reading the Q4_0 GGUF we wrote (fp32; its GGUF reader takes ~15 s)."""
    pytest.importorskip("accelerate")  # transformers needs it for gguf_file=
    d, name = os.path.split(q4_0_gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_logits(hf_model, ids) -> torch.Tensor:
    """HF fp32 logits [T, vocab] for every position of ``ids``."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def test_transformers_reads_the_q4_0_file_we_wrote(hf_model, bundled_model: LoadedModel):
    """`tandem quantize`'s file, read by ``transformers``: the values of our in-memory Q4_0
    weights exactly, Q/K rows included (llama.cpp's row permutation undone the same way)."""
    sd = hf_model.state_dict()
    w = bundled_model.weights
    for ours, theirs in [("token_embd", "model.embed_tokens.weight"),
                         ("blk.0.attn_q", "model.layers.0.self_attn.q_proj.weight"),
                         ("blk.0.attn_k", "model.layers.0.self_attn.k_proj.weight"),
                         ("blk.7.attn_v", "model.layers.7.self_attn.v_proj.weight"),
                         ("blk.29.ffn_down", "model.layers.29.mlp.down_proj.weight")]:
        assert torch.equal(q4_0.dequantize(w[ours]), sd[theirs]), ours
    assert torch.equal(w["blk.3.attn_norm"], sd["model.layers.3.input_layernorm.weight"])


@pytest.fixture
def cpu_act():
    """Restore the CPU kernels' activation mode after a test that sets it."""
    from kernels import cpu
    before = cpu.act()
    yield cpu.set_act
    cpu.set_act(before)


# the default kernels and the torch reference; the other activation modes (settings) in the slow lane
@pytest.mark.parametrize("kernels", ["auto", pytest.param("auto-f32", marks=pytest.mark.slow),
                                     pytest.param("auto-q8", marks=pytest.mark.slow), "reference"])
def test_logits_match_transformers(kernels, q4_model, ids, hf_logits, bundled_model, monkeypatch, cpu_act):
    assert q4_model.identity == bundled_model.identity  # the Q4_0 GGUF holds exactly the weights we run
    path, _, act = kernels.partition("-")
    monkeypatch.setenv("TANDEM_KERNELS", path)  # read by kernels.dispatch.get_ops in Engine()
    if path == "auto":
        cpu_act(act or "q16")  # "auto": the default (q16); "auto-f32" / "auto-q8": those activations
    engine = Engine(q4_model, EngineConfig(num_kv_blocks=(len(ids) + 15) // 16, block_size=16))
    ours = engine.prompt_logits(ids)
    assert ours.shape == hf_logits.shape

    diff = (ours - hf_logits).abs()
    agree = ours.argmax(-1) == hf_logits.argmax(-1)
    top2 = hf_logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) >= DECISIVE
    top1, top1_decisive = agree.float().mean().item(), agree[decisive].float().mean().item()
    max_d, mean_d = diff.max().item(), diff.mean().item()
    print(f"\n[hf parity, kernels={kernels}, {len(ids)} tokens] top-1 agreement {top1:.4f} "
          f"({int((~agree).sum())} differ; {top1_decisive:.4f} on the {int(decisive.sum())} decisive positions), "
          f"max |dlogit| {max_d:.4f}, mean |dlogit| {mean_d:.5f}")
    min_top1, min_decisive, max_bound, mean_bound = BOUNDS[kernels]
    assert top1 >= min_top1, f"top-1 agreement {top1:.4f} < {min_top1}"
    assert top1_decisive >= min_decisive, f"top-1 agreement on decisive positions {top1_decisive:.4f} < {min_decisive}"
    assert max_d <= max_bound, f"max |dlogit| {max_d:.4f} > {max_bound}"
    assert mean_d <= mean_bound, f"mean |dlogit| {mean_d:.5f} > {mean_bound}"
