"""Single-forward parity with DeepSpec's golden tensors (float32, atol = rtol = 1e-4)."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import GOLDEN_DRAFTERS, golden_path
from safetensors.torch import load_file, save_file

from dspark.models import CheckpointError, DSparkDrafter, TargetModel, load_pair
from dspark.tools.golden_report import single_forward_tensors

TOL = dict(atol=1e-4, rtol=1e-4)


def _close(name: str, ours: torch.Tensor, golden: torch.Tensor) -> None:
    assert ours.shape == golden.shape, f"{name}: shape {tuple(ours.shape)} vs golden {tuple(golden.shape)}"
    diff = (ours - golden).abs().max().item() if ours.numel() else 0.0
    torch.testing.assert_close(ours, golden, **TOL, msg=f"{name}: max |diff| {diff:.3g}")


@pytest.fixture(scope="module", params=GOLDEN_DRAFTERS, ids=lambda c: f"{c.set_name}/{c.drafter_dir}")
def golden(request):
    case = request.param
    root = golden_path(case.set_name)
    target, drafter = load_pair(root / "target", root / case.drafter_dir)
    return target, drafter, load_file(str(root / f"tensors{case.stem}.safetensors"))


@torch.no_grad()
def test_target_forward(golden):
    target, _, g = golden
    ids = g["prompt_ids"]
    n = ids.shape[1]
    out = target(ids, torch.arange(n)[None])
    _close("target_logits", out.logits, g["target_logits"])
    _close("context_features", out.context_features, g["context_features"])
    # Every non-final hidden state, read through the layer-id convention (-1 = embeddings).
    layers = target.config.num_hidden_layers
    probe = TargetModel(target.config, tuple(range(-1, layers - 1)))
    probe.load_state_dict(target.state_dict())
    hidden = probe(ids, torch.arange(n)[None]).context_features.split(target.config.hidden_size, dim=-1)
    _close("target_hidden_states", torch.stack(hidden), g["target_hidden_states_all"][:layers])


def test_draft_block(golden):
    target, drafter, g = golden
    gamma = drafter.config.block_size
    expected_block = torch.cat((g["draft_anchor_token"].reshape(1, 1),
                                torch.full((1, gamma - 1), drafter.config.mask_token_id)), dim=1)
    assert torch.equal(expected_block, g["draft_input_ids"])
    tensors = single_forward_tensors(target, drafter, g)
    assert torch.equal(*tensors.pop("draft_tokens"))
    assert ("confidence_logits" in tensors) == (drafter.confidence_head is not None) == ("confidence_logits" in g)
    if drafter.confidence_head is not None:
        prev = torch.cat((g["draft_anchor_token"].reshape(1, 1), g["draft_tokens"][:, :-1]), dim=1)
        assert torch.equal(prev, g["confidence_prev_token_ids"])
    for name, (ours, reference) in tensors.items():
        _close(name, ours, reference)


def test_drafter_shares_embeddings_when_checkpoint_omits_them(tmp_path):
    """A drafter saved without embed_tokens/lm_head takes the target's (DeepSpec copies them)."""
    root = golden_path("qwen3-tiny-vanilla")
    target, drafter = load_pair(root / "target", root / "drafter")
    shared = ("embed_tokens.weight", "lm_head.weight")
    kept = {k: v for k, v in drafter.state_dict().items() if k not in shared}
    save_file(kept, str(tmp_path / "model.safetensors"))
    shutil.copy(root / "drafter" / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="shares them with its target"):
        DSparkDrafter.from_pretrained(tmp_path)
    loaded = DSparkDrafter.from_pretrained(tmp_path, target=target)
    assert loaded.embed_tokens.weight is target.embed_tokens.weight
    assert loaded.lm_head.weight is target.lm_head.weight
    assert torch.equal(loaded.norm.weight, drafter.norm.weight)
