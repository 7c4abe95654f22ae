"""Unit checks of the training forward pieces on tiny random drafters (no golden data needed)."""

from __future__ import annotations

import torch

from dspark.models import DrafterConfig, DSparkDrafter
from dspark.models.loss import DFLASH_WEIGHTS, dspark_loss, position_weights
from dspark.models.training import block_attention_mask, sample_anchor_positions, training_forward
from dspark.tools.demo_training import drafter_config_dict, init_weights, target_config_dict


def _drafter(markov_rank: int, confidence: bool) -> DSparkDrafter:
    target = target_config_dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_id=0)
    config = drafter_config_dict(target, block_size=4, num_draft_layers=1, target_layer_ids=[0, 1],
                                 mask_token_id=1, num_anchors=3, markov_rank=markov_rank,
                                 confidence_head=confidence)
    torch.manual_seed(0)
    drafter = DSparkDrafter(DrafterConfig.from_dict(config))
    init_weights(drafter, std=0.2)
    return drafter


def test_too_few_candidates_pad_with_dropped_blocks() -> None:
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0]])  # candidates: 2, 3
    rng = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchor_positions(loss_mask, num_anchors=4, generator=rng)
    assert anchors.tolist() == [[2, 3, 0, 0]]
    assert keep.tolist() == [[True, True, False, False]]


def test_block_mask_sees_earlier_context_and_own_block_only() -> None:
    mask = block_attention_mask(torch.tensor([[1, 3]]), block_size=2, context_len=4)[0, 0]
    assert mask.shape == (4, 8)
    expected = torch.tensor([
        # ctx 0..3     block0  block1
        [1, 0, 0, 0,   1, 1,   0, 0],
        [1, 0, 0, 0,   1, 1,   0, 0],
        [1, 1, 1, 0,   0, 0,   1, 1],
        [1, 1, 1, 0,   0, 0,   1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_blocks_are_independent_of_each_other() -> None:
    # A block's logits depend only on its anchor, so running the anchors one at a time must agree.
    drafter = _drafter(markov_rank=8, confidence=True).eval()
    n = 12
    ids = torch.randint(2, 64, (1, n), generator=torch.Generator().manual_seed(1))
    feats, last = torch.randn(1, n, 64), torch.randn(1, n, 32)
    kw = {"input_ids": ids, "context_features": feats, "target_last_hidden": last,
          "loss_mask": torch.ones(1, n)}
    with torch.no_grad():
        both = training_forward(drafter, anchor_positions=torch.tensor([[2, 7]]), **kw)
        alone = training_forward(drafter, anchor_positions=torch.tensor([[7]]), **kw)
    torch.testing.assert_close(both.draft_logits[:, 1], alone.draft_logits[:, 0])
    torch.testing.assert_close(both.confidence_logits[:, 1], alone.confidence_logits[:, 0])


def test_loss_weights_decay_and_dflash_has_no_confidence_term() -> None:
    w = position_weights(torch.tensor([[[True, True, True, False]]]), decay_gamma=4.0)
    torch.testing.assert_close(w[0, 0], torch.tensor([1.0, torch.e ** -0.25, torch.e ** -0.5, 0.0]))
    drafter = _drafter(markov_rank=0, confidence=False)
    n = 10
    ids = torch.randint(2, 64, (2, n), generator=torch.Generator().manual_seed(2))
    out = training_forward(drafter, input_ids=ids, context_features=torch.randn(2, n, 64),
                           target_last_hidden=torch.randn(2, n, 32), loss_mask=torch.ones(2, n),
                           generator=torch.Generator().manual_seed(3))
    loss = dspark_loss(out, DFLASH_WEIGHTS)
    assert out.confidence_logits is None and float(loss.confidence) == 0.0
    torch.testing.assert_close(loss.total, loss.ce)
    loss.total.backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
