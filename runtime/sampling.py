"""Turning logits into distributions and tokens (greedy when temperature is 0)."""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] at `temperature` (> 0), computed in float32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_token(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [N, V] -> token ids [N]; argmax (first maximum) when temperature == 0."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = probabilities(logits, temperature)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
