"""The training-mode forward and loss reproduce DeepSpec's recorded tensors on every golden set."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dspark.models import DSparkDrafter, TargetModel
from dspark.models.config import DrafterConfig
from dspark.models.loss import LossWeights, dspark_loss
from dspark.models.training import sample_anchor_positions, target_training_features, training_forward

_DEFAULT_GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
GOLDEN = Path(os.environ.get("DSPARK_GOLDEN", _DEFAULT_GOLDEN))
SETS = {  # name -> (set folder, tensors file stem, drafter folder)
    "vanilla": ("qwen3-tiny-vanilla", "tensors", "drafter"),
    "gated": ("qwen3-tiny-gated-rnn", "tensors_gated", "drafter_gated"),
    "rnn": ("qwen3-tiny-gated-rnn", "tensors_rnn", "drafter_rnn"),
    "dflash": ("dflash-tiny", "tensors", "drafter"),
}
TOL = {"atol": 1e-4, "rtol": 1e-4}

pytestmark = pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"golden fixtures not found at {GOLDEN}")


def _load(name: str):
    folder, stem, drafter_dir = SETS[name]
    root = GOLDEN / folder
    tensors = load_file(str(root / f"{stem}.safetensors"))
    info = json.loads((root / f"{stem}.json").read_text())["info"]
    layer_ids = DrafterConfig.from_folder(root / drafter_dir).target_layer_ids
    target = TargetModel.from_pretrained(root / "target", layer_ids)
    drafter = DSparkDrafter.from_pretrained(root / drafter_dir, target=target)
    return tensors, info, target, drafter


@pytest.mark.parametrize("name", sorted(SETS))
def test_training_forward_matches_deepspec(name: str) -> None:
    g, info, target, drafter = _load(name)
    ids = g["prompt_ids"]
    features, last_hidden = target_training_features(target, ids)
    torch.testing.assert_close(features, g["context_features"], **TOL)
    torch.testing.assert_close(last_hidden, g["train_last_hidden_states"], **TOL)

    with torch.no_grad():
        out = training_forward(
            drafter,
            input_ids=ids,
            context_features=features,
            target_last_hidden=last_hidden,
            loss_mask=g["train_loss_mask"],
            anchor_positions=g["train_anchor_positions"],
        )
        loss = dspark_loss(out, LossWeights(**_weights(info)))
    assert torch.equal(out.target_ids, g["train_target_ids"])
    assert torch.equal(out.eval_mask, g["train_eval_mask"])
    assert torch.equal(out.block_keep_mask, g["train_block_keep_mask"])
    torch.testing.assert_close(out.draft_logits, g["train_draft_logits"], **TOL)
    torch.testing.assert_close(out.aligned_target_logits, g["train_aligned_target_logits"], **TOL)
    if "train_confidence_pred" in g:
        torch.testing.assert_close(out.confidence_logits, g["train_confidence_pred"], **TOL)
    else:
        assert out.confidence_logits is None
    torch.testing.assert_close(loss.total.reshape(1), g["train_loss"], **TOL)


def _weights(info: dict) -> dict:
    kw = info["train_forward"]["loss_kwargs"]
    return {
        "ce": kw["ce_loss_alpha"],
        "tv": kw["l1_loss_alpha"],
        "confidence": kw["confidence_head_alpha"],
        "decay_gamma": kw["loss_decay_gamma"],
    }


def test_anchor_sampling_reproduces_recorded_anchors() -> None:
    # DeepSpec draws the anchors right after torch.manual_seed(1234): same RNG use, same anchors.
    g, *_ = _load("vanilla")
    torch.manual_seed(1234)
    anchors, keep = sample_anchor_positions(g["train_loss_mask"], num_anchors=8)
    assert torch.equal(anchors, g["train_anchor_positions"])
    assert keep.all()
