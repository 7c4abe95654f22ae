"""DeepSpec's training-mode forward for a DSpark/DFlash drafter, in plain torch.

One training sequence of n tokens carries `num_anchors` draft blocks. Block b starts at an
anchor position a_b: `[input_ids[a_b], mask x (γ-1)]` at positions a_b .. a_b+γ-1. It sees the
target's context rows with position < a_b and its own γ slots, exactly what the block sees at
decoding time when a_b is the last committed token. All blocks of a row run as one stream of
A·γ tokens under a block-diagonal + context mask, so one backbone call covers every anchor.

Slot k of block b is trained on the token at position a_b+k+1 (teacher-forced: the Markov and
confidence heads see the true previous token), against both the data token (CE) and the
target's own distribution at that position (`aligned_target_logits`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafter import DSparkDrafter
from .target import TargetModel


@dataclass
class DraftTrainingOutput:
    """B = batch, A = anchors per row, γ = block size, V = vocab."""

    anchor_positions: torch.Tensor  # [B, A] int64, ascending within a row
    block_keep_mask: torch.Tensor  # [B, A] bool, False for padding blocks (too few candidates)
    draft_logits: torch.Tensor  # [B, A, γ, V] Markov-corrected, teacher-forced
    confidence_logits: torch.Tensor | None  # [B, A, γ] pre-sigmoid, None without a confidence head
    target_ids: torch.Tensor  # [B, A, γ] int64 data labels input_ids[min(a+k+1, n-1)]
    eval_mask: torch.Tensor  # [B, A, γ] bool: label in range, in the loss mask, prefix all valid
    aligned_target_logits: torch.Tensor  # [B, A, γ, V] the target's logits for the same positions


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [B, n] -> [B, n-1] bool: a may anchor a block when a and a+1 are in the loss."""
    on = loss_mask.bool()
    return on[:, :-1] & on[:, 1:]


def sample_anchor_positions(
    loss_mask: torch.Tensor,  # [B, n] float or bool
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw `num_anchors` distinct candidates per row uniformly (uniform keys, smallest first),
    sorted ascending. Rows with fewer candidates are padded with anchor 0 and keep = False.

    -> anchor positions [B, A] int64, block keep mask [B, A] bool.
    """
    valid = anchor_candidates(loss_mask)
    keys = torch.rand(valid.shape, generator=generator, device=valid.device)
    keys = keys.masked_fill(~valid, float("inf"))
    count = min(num_anchors, valid.shape[1])
    chosen = keys.argsort(dim=1)[:, :count]
    keep = torch.gather(valid, 1, chosen)
    if count < num_anchors:
        pad = num_anchors - count
        chosen = torch.cat((chosen, chosen.new_zeros(chosen.shape[0], pad)), dim=1)
        keep = torch.cat((keep, keep.new_zeros(keep.shape[0], pad)), dim=1)
    anchors = torch.where(keep, chosen, torch.zeros_like(chosen))
    # Kept anchors first in ascending order, padding blocks last.
    order = torch.where(keep, anchors, torch.full_like(anchors, valid.shape[1] + 1)).argsort(dim=1)
    return torch.gather(anchors, 1, order), torch.gather(keep, 1, order)


def block_attention_mask(
    anchor_positions: torch.Tensor,  # [B, A]
    block_size: int,
    context_len: int,
) -> torch.Tensor:
    """[B, 1, A·γ, n + A·γ] bool: block b sees context positions < a_b and its own γ slots."""
    batch, anchors = anchor_positions.shape
    device = anchor_positions.device
    query_anchor = anchor_positions.repeat_interleave(block_size, dim=1)  # [B, A·γ]
    sees_context = torch.arange(context_len, device=device)[None, None, :] < query_anchor[:, :, None]
    block_of = torch.arange(anchors * block_size, device=device) // block_size
    same_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    return torch.cat((sees_context, same_block), dim=2)[:, None]


def training_forward(
    drafter: DSparkDrafter,
    *,
    input_ids: torch.Tensor,  # [B, n] int64
    context_features: torch.Tensor,  # [B, n, F] target features of every position
    target_last_hidden: torch.Tensor,  # [B, n, H] final-normed last hidden state of the target
    loss_mask: torch.Tensor,  # [B, n] 1 where a token is trained on
    anchor_positions: torch.Tensor | None = None,  # [B, A]; None = sample config.num_anchors
    block_keep_mask: torch.Tensor | None = None,  # [B, A]; None = all kept (given anchors)
    generator: torch.Generator | None = None,
) -> DraftTrainingOutput:
    config = drafter.config
    batch, n = input_ids.shape
    gamma = config.block_size
    if context_features.shape[:2] != (batch, n) or target_last_hidden.shape[:2] != (batch, n):
        raise ValueError(
            f"context_features {tuple(context_features.shape)} and target_last_hidden "
            f"{tuple(target_last_hidden.shape)} must both start with input_ids' shape {(batch, n)}"
        )
    if anchor_positions is None:
        anchor_positions, block_keep_mask = sample_anchor_positions(loss_mask, config.num_anchors, generator)
    elif block_keep_mask is None:
        block_keep_mask = torch.ones_like(anchor_positions, dtype=torch.bool)
    anchors = anchor_positions.shape[1]
    device = input_ids.device

    offsets = torch.arange(gamma, device=device)
    slot_positions = anchor_positions[:, :, None] + offsets  # [B, A, γ]
    block_ids = input_ids.new_full((batch, anchors, gamma), config.mask_token_id)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchor_positions)

    out = drafter.forward_backbone(
        block_ids=block_ids.view(batch, anchors * gamma),
        block_position_ids=slot_positions.view(batch, anchors * gamma),
        context_features=context_features,
        context_position_ids=torch.arange(n, device=device).expand(batch, n),
        attention_mask=block_attention_mask(anchor_positions, gamma, n),
    )
    hidden = out.hidden.view(batch * anchors, gamma, -1)

    label_index = slot_positions + 1  # [B, A, γ]
    clamped = label_index.clamp(max=n - 1)
    flat = clamped.view(batch, anchors * gamma)
    target_ids = torch.gather(input_ids, 1, flat).view(batch, anchors, gamma)
    in_loss = torch.gather(loss_mask.bool(), 1, flat).view(batch, anchors, gamma)
    valid = (label_index < n) & in_loss & block_keep_mask[:, :, None]
    eval_mask = torch.cumprod(valid.int(), dim=2).bool()

    prev_ids = torch.cat((block_ids[:, :, :1], target_ids[:, :, :-1]), dim=2)
    draft_logits, confidence = drafter.teacher_forced_heads(hidden, prev_ids.view(batch * anchors, gamma))

    row = torch.arange(batch, device=device)[:, None]
    aligned_hidden = target_last_hidden[row, (flat - 1)]  # [B, A·γ, H]
    aligned = drafter.base_logits(aligned_hidden).view(batch, anchors, gamma, -1)
    return DraftTrainingOutput(
        anchor_positions=anchor_positions,
        block_keep_mask=block_keep_mask,
        draft_logits=draft_logits.view(batch, anchors, gamma, -1),
        confidence_logits=None if confidence is None else confidence.view(batch, anchors, gamma),
        target_ids=target_ids,
        eval_mask=eval_mask,
        aligned_target_logits=aligned,
    )


@torch.no_grad()
def target_training_features(
    target: TargetModel, input_ids: torch.Tensor  # [B, n]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal target forward -> context features [B, n, F], final-normed hidden [B, n, H]."""
    captured: list[torch.Tensor] = []
    handle = target.norm.register_forward_hook(lambda _m, _i, output: captured.append(output))
    try:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        out = target(input_ids, positions)
    finally:
        handle.remove()
    return out.context_features, captured[-1]
