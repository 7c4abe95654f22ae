"""How many draft tokens to verify: static policies (the prefix scheduler builds on these)."""

from __future__ import annotations

import torch


def threshold_length(confidence_logits: torch.Tensor, threshold: float) -> int:
    """Index of the first slot whose confidence σ(c_k) falls below `threshold` (per position, not
    cumulative, as DeepSpec's static threshold does), or every slot if none does; every slot when
    threshold <= 0. confidence_logits [γ]."""
    if threshold <= 0.0:
        return confidence_logits.shape[0]
    below = (torch.sigmoid(confidence_logits) < threshold).nonzero()
    return int(below[0]) if below.numel() else confidence_logits.shape[0]
