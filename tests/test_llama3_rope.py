"""Llama-3.1's `llama3` RoPE scaling through the whole export: a Llama-3.1-configured pair (the model
card's config.json with small widths) streamed to ONNX, its target graph at parity with PyTorch, and
the scaling baked into the graph (a graph without it differs). The decoder itself is checked against
transformers' LlamaForCausalLM in test_target_hf_parity.py."""

from __future__ import annotations

import torch

from dspark.export import feeds as F
from dspark.export import parity as P
from dspark.export.pipeline import graph_jobs
from dspark.export.streaming import export_pair_streaming
from dspark.models import TargetConfig, load_pair
from dspark.models.layers import RotaryEmbedding
from dspark.tools import checkpoint_fixtures as fixtures

# Head dim 16 over theta 5e5 and the card's 8192-token original context: of the 8 frequencies, 4
# are kept, 1 is blended and 3 are slowed 8x.
SMALL_WIDTHS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def _llama31_pair(out):
    target = {**fixtures.MODELS["llama-3.1-8b"], **SMALL_WIDTHS, "initializer_range": 0.2}
    drafter = {**fixtures.drafter_config(target, drafter_layers=1), "mask_token_id": 255, "markov_rank": 8}
    fixtures.write_checkpoint(out / "target", target, fixtures.target_tensors(target, drafter["target_layer_ids"]))
    fixtures.write_checkpoint(out / "drafter", drafter, fixtures.drafter_tensors(drafter))
    return out / "target", out / "drafter"


def test_the_card_config_loads_with_its_scaling():
    config = TargetConfig.from_dict(fixtures.MODELS["llama-3.1-8b"])
    scaling = config.layout(0).rope_scaling
    assert scaling is not None and (scaling.factor, scaling.original_max_position_embeddings) == (8.0, 8192)
    plain = RotaryEmbedding(128, config.rope_theta).inv_freq
    ratio = plain / RotaryEmbedding.for_layout(config.layout(0)).inv_freq
    assert ratio.min() == 1.0 and torch.isclose(ratio.max(), torch.tensor(8.0))


def test_a_streamed_llama31_target_graph_keeps_the_scaling(tmp_path, monkeypatch):
    target_dir, drafter_dir = _llama31_pair(tmp_path / "pair")
    out = tmp_path / "export"
    manifest = export_pair_streaming(target_dir, drafter_dir, out, graphs_only=("target",))
    target, drafter = load_pair(target_dir, drafter_dir)
    ratio = RotaryEmbedding(16, 5e5).inv_freq / target.rotary.inv_freq
    assert ((ratio > 1.01) & (ratio < 7.99)).sum() == 1 and (ratio == 1).sum() == 4
    job = next(job for job in graph_jobs(target, drafter, "float32") if job.spec.name == "target")
    monkeypatch.setattr(P, "TARGET_CASES", (F.Case(1, 9, 0), F.Case(2, 4, 300, "padded")))
    session = P.session(out / manifest["graphs"]["target"]["file"])
    with torch.no_grad():
        assert max(job.parity(session, job.spec)["max_abs_diff"].values()) <= 1e-4
        # the control: the same weights with plain RoPE are not what the graph computes
        target.rotary.inv_freq.copy_(RotaryEmbedding(16, 5e5).inv_freq)
        assert max(job.parity(session, job.spec)["max_abs_diff"].values()) > 1e-2
