"""DSpark's training objective (DeepSpec `compute_dspark_loss`, one process).

With w = eval_mask · exp(−k/γ_decay) for block slot k, every term is a w-weighted mean:
  CE   cross-entropy of the draft logits against the data token,
  TV   ‖softmax(draft) − softmax(target)‖₁ (the L1 form of total variation),
  conf BCE(confidence logit, clamp(1 − ½‖p_d − p_t‖₁, 0, 1)): the soft label is the chance
       that the draft token survives verification against the target.
DFlash is the same objective with (ce, tv, confidence) = (1, 0, 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .training import DraftTrainingOutput

_EPS = 1e-6


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0
    decay_gamma: float = 4.0


DSPARK_WEIGHTS = LossWeights()
DFLASH_WEIGHTS = LossWeights(ce=1.0, tv=0.0, confidence=0.0)


@dataclass
class LossBreakdown:
    total: torch.Tensor  # [] what the optimizer minimises
    ce: torch.Tensor  # []
    tv: torch.Tensor  # []
    confidence: torch.Tensor  # [] zero without a confidence head


def position_weights(eval_mask: torch.Tensor, decay_gamma: float) -> torch.Tensor:
    """eval_mask [B, A, γ] -> weights [B, A, γ] = mask · exp(−k/γ_decay)."""
    k = torch.arange(eval_mask.shape[-1], device=eval_mask.device, dtype=torch.float32)
    return eval_mask.float() * torch.exp(-k / decay_gamma)


def dspark_loss(out: DraftTrainingOutput, weights: LossWeights = DSPARK_WEIGHTS) -> LossBreakdown:
    w = position_weights(out.eval_mask, weights.decay_gamma)
    norm = w.sum() + _EPS
    logits = out.draft_logits.float()
    ce = F.cross_entropy(logits.flatten(0, 2), out.target_ids.flatten(), reduction="none").view_as(w)
    p_draft = torch.softmax(logits, dim=-1)
    p_target = torch.softmax(out.aligned_target_logits.float(), dim=-1)
    l1 = (p_draft - p_target).abs().sum(dim=-1)  # [B, A, γ]
    ce_term = (w * ce).sum() / norm
    tv_term = (w * l1).sum() / norm
    conf_term = torch.zeros((), device=w.device)
    if out.confidence_logits is not None:
        label = (1 - 0.5 * l1.detach()).clamp(0, 1)
        bce = F.binary_cross_entropy_with_logits(out.confidence_logits.float(), label, reduction="none")
        conf_term = (w * bce).sum() / norm
    total = weights.ce * ce_term + weights.tv * tv_term + weights.confidence * conf_term
    return LossBreakdown(total=total, ce=ce_term, tv=tv_term, confidence=conf_term)
