"""Gemma-4 at real size: the Gemma-4-12B fixture's config (tools/checkpoint_fixtures.py) and the
streamed export (export/streaming.py) of a Gemma-4 pair, whose checkpoint nests the decoder under
model.language_model and stores per-layer `layer_scalar` buffers the graph must hold.

The streamed export runs on DeepSpec's gemma4-tiny golden pair (float32; its layer scalars are
0.8-1.2, not the default 1), against the PyTorch pair loaded the ordinary way."""

from __future__ import annotations

import pytest
import torch
from conftest import golden_path

from dspark.export import feeds as F
from dspark.export import parity as P
from dspark.export.pipeline import graph_jobs
from dspark.export.streaming import export_pair_streaming
from dspark.models import DrafterConfig, TargetConfig, load_pair
from dspark.models.drafter import check_drafter_fits_target
from dspark.tools import checkpoint_fixtures as fixtures


def test_the_12b_config_has_the_model_cards_shape():
    config = fixtures.target_config("gemma-4-12b")
    drafter = fixtures.drafter_config(config, layer_ids=fixtures.RECIPE_LAYER_IDS["gemma-4-12b"])
    shapes = fixtures.target_tensors(config, drafter["target_layer_ids"])
    parameters = sum(int(torch.Size(s).numel()) for s in shapes.values())
    assert abs(parameters / 11.95e9 - 1) < 0.005, parameters  # the card's 11.95B
    parsed = TargetConfig.from_dict(config)
    kinds = [lay.sliding_window for lay in parsed.layouts]
    assert kinds.count(None) == 8 and kinds[-1] is None and set(kinds) == {None, 1024}
    global_layer = parsed.layout(47)
    assert (global_layer.head_dim, global_layer.num_key_value_heads, global_layer.keys_are_values) == (512, 4, True)
    assert global_layer.rotary_pairs == 64  # proportional RoPE: a quarter of 256 pairs rotate
    assert all(k.startswith("model.language_model.") for k in shapes)  # Gemma4ForConditionalGeneration's names
    assert (drafter["target_layer_ids"], drafter["mask_token_id"], drafter["markov_rank"]) == ([5, 17, 29, 41, 46],
                                                                                                4, 256)
    check_drafter_fits_target(DrafterConfig.from_dict(drafter), parsed)
    few = fixtures.target_config("gemma-4-12b", layers=3)["text_config"]["layer_types"]
    assert few == ["sliding_attention", "sliding_attention", "full_attention"]


@pytest.mark.parametrize("graph", ["target", "drafter_backbone"])
def test_a_streamed_gemma4_pair_matches_pytorch(tmp_path, monkeypatch, graph):
    target_dir, drafter_dir = golden_path("gemma4-tiny", "target"), golden_path("gemma4-tiny", "drafter")
    manifest = export_pair_streaming(target_dir, drafter_dir, tmp_path, graphs_only=(graph,))
    target, drafter = load_pair(target_dir, drafter_dir)
    assert sorted({round(float(layer.layer_scalar), 2) for layer in target.layers}) != [1.0]
    job = next(job for job in graph_jobs(target, drafter, "float32") if job.spec.name == graph)
    # past the 16-token window, so sliding layers mask part of it
    monkeypatch.setattr(P, "TARGET_CASES", (F.Case(1, 24, 0), F.Case(2, 3, 30, "padded")))
    monkeypatch.setattr(P, "BACKBONE_CASES", (F.Case(1, 24, 0), F.Case(2, 3, 30, "padded")))
    with torch.no_grad():
        result = job.parity(P.session(tmp_path / manifest["graphs"][graph]["file"]), job.spec)
    assert max(result["max_abs_diff"].values()) <= 1e-4, result["max_abs_diff"]
