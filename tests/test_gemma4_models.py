"""Gemma-4 target and DSpark drafter against DeepSpec's gemma4-tiny golden set (float32,
atol = rtol = 1e-4): the single forward, round 0's draft block, the training forward and loss,
and the refusals of what the family's dense text decoder does not have."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import golden_path
from safetensors.torch import load_file

from dspark.models import (
    CheckpointError,
    DrafterConfig,
    IncompatibleDrafterError,
    TargetConfig,
    TargetModel,
    load_pair,
)
from dspark.models.loss import LossWeights, dspark_loss
from dspark.models.training import target_training_features, training_forward
from dspark.runtime.prefix_scheduler import threshold_length
from dspark.tools.golden_report import single_forward_tensors

SET = "gemma4-tiny"
TOL = dict(atol=1e-4, rtol=1e-4)
pytestmark = pytest.mark.usefixtures("one_thread")


def _close(name: str, ours: torch.Tensor, golden: torch.Tensor) -> None:
    assert ours.shape == golden.shape, f"{name}: shape {tuple(ours.shape)} vs golden {tuple(golden.shape)}"
    diff = (ours - golden).abs().max().item()
    torch.testing.assert_close(ours, golden, **TOL, msg=f"{name}: max |diff| {diff:.3g}")


@pytest.fixture(scope="module")
def golden():
    root = golden_path(SET)
    target, drafter = load_pair(root / "target", root / "drafter")
    return target, drafter, load_file(str(root / "tensors.safetensors"))


def test_config_reads_both_layouts():
    config = TargetConfig.from_folder(golden_path(SET, "target"))
    sliding, full = config.layout(0), config.layout(2)
    assert [lay.sliding_window for lay in config.layouts] == [16, 16, None, 16, 16, None]
    assert (sliding.head_dim, sliding.num_key_value_heads, sliding.rotary_pairs, sliding.keys_are_values) \
        == (16, 2, 8, False)
    assert (full.head_dim, full.num_key_value_heads, full.rotary_pairs, full.keys_are_values) == (32, 1, 4, True)
    assert (config.embedding_scale, config.attention_scale, config.final_logit_softcapping) == (8.0, 1.0, 30.0)
    drafter = DrafterConfig.from_folder(golden_path(SET, "drafter"))
    assert drafter.layouts == (full, full)  # global-style draft layers


@torch.no_grad()
def test_target_forward(golden):
    target, _, g = golden
    ids = g["prompt_ids"]
    n, layers = ids.shape[1], target.config.num_hidden_layers
    out = target(ids, torch.arange(n)[None])
    _close("target_logits", out.logits, g["target_logits"])
    _close("context_features", out.context_features, g["context_features"])
    probe = TargetModel(target.config, tuple(range(-1, layers - 1)))
    probe.load_state_dict(target.state_dict())
    raw: list[torch.Tensor] = []
    probe.layers[-1].register_forward_hook(lambda _m, _i, output: raw.append(output[0]))
    hidden = probe(ids, torch.arange(n)[None]).context_features.split(target.config.hidden_size, dim=-1)
    _close("target_hidden_states (embeddings, layers 0..L-2)", torch.stack(hidden),
           g["target_hidden_states_all"][:layers])
    _close("target_last_layer_raw", raw[0], g["target_last_layer_raw"])
    final = probe.norm(raw[0])
    _close("target_hidden_states[L] (final-normed)", final, g["target_hidden_states_all"][layers])
    _close("target_logits_pre_softcap", probe.lm_head(final), g["target_logits_pre_softcap"])


@torch.no_grad()
def test_draft_block(golden):
    target, drafter, g = golden
    tensors = single_forward_tensors(target, drafter, g)
    assert torch.equal(*tensors.pop("draft_tokens"))
    for name, (ours, reference) in tensors.items():
        _close(name, ours, reference)
    block = g["draft_input_ids"]
    _close("draft_noise_embedding", drafter.embed_tokens(block) * drafter.config.embedding_scale,
           g["draft_noise_embedding"])
    _close("draft_lm_head_raw", drafter.lm_head(tensors["draft_block_hidden"][0]), g["draft_lm_head_raw"])
    # The proposal at both thresholds: [anchor, the first k draft tokens].
    for key, threshold in (("proposal_verify_input_ids", 0.0), ("proposal_verify_input_ids_threshold_0.5", 0.5)):
        k = threshold_length(tensors["confidence_logits"][0][0], threshold)
        ours = torch.cat((g["draft_anchor_token"], g["draft_tokens"][0, :k]))[None]
        assert torch.equal(ours, g[key]), key


@torch.no_grad()
def test_training_forward_and_loss(golden):
    target, drafter, g = golden
    info = json.loads(golden_path(SET, "tensors.json").read_text())["info"]["train_forward"]["loss_kwargs"]
    features, last_hidden = target_training_features(target, g["prompt_ids"])
    _close("train_last_hidden_states", last_hidden, g["train_last_hidden_states"])
    out = training_forward(drafter, input_ids=g["prompt_ids"], context_features=features,
                           target_last_hidden=last_hidden, loss_mask=g["train_loss_mask"],
                           anchor_positions=g["train_anchor_positions"])
    loss = dspark_loss(out, LossWeights(ce=info["ce_loss_alpha"], tv=info["l1_loss_alpha"],
                                        confidence=info["confidence_head_alpha"],
                                        decay_gamma=info["loss_decay_gamma"]))
    assert torch.equal(out.target_ids, g["train_target_ids"])
    assert torch.equal(out.eval_mask, g["train_eval_mask"])
    _close("train_draft_logits", out.draft_logits, g["train_draft_logits"])
    _close("train_aligned_target_logits", out.aligned_target_logits, g["train_aligned_target_logits"])
    _close("train_confidence_pred", out.confidence_logits, g["train_confidence_pred"])
    _close("train_loss", loss.total.reshape(1), g["train_loss"])


def _edited_target(tmp_path, edit) -> str:
    folder = tmp_path / "target"
    shutil.copytree(golden_path(SET, "target"), folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda c: c.update(vision_config={"model_type": "gemma4_vision"}), "vision_config towers are not supported"),
    (lambda c: c["text_config"].update(enable_moe_block=True), r"MoE blocks \(enable_moe_block\) not supported"),
    (lambda c: c["text_config"].update(hidden_size_per_layer_input=256), "per-layer input embeddings"),
    (lambda c: c["text_config"].update(layer_types=["sliding_attention"] * 5), "'layer_types' must list 6"),
], ids=["tower", "moe", "per-layer-embeddings", "layer-types"])
def test_refusals_name_the_feature(tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message) as info:
        TargetModel.from_pretrained(_edited_target(tmp_path, edit))
    assert "\n" not in str(info.value)


def test_a_drafter_of_the_other_family_is_refused():
    gemma = golden_path(SET)
    qwen3 = golden_path("qwen3-tiny-vanilla")
    with pytest.raises(IncompatibleDrafterError, match="a Gemma-4 drafter for a 'qwen3' target"):
        load_pair(qwen3 / "target", gemma / "drafter")
    with pytest.raises(IncompatibleDrafterError, match="a Qwen3-style drafter for a 'gemma4' target"):
        load_pair(gemma / "target", qwen3 / "drafter")
