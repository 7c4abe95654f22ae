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


def sample_rows(
    logits: torch.Tensor,  # [N, V]
    temperatures: list[float],  # per row
    generators: list[torch.Generator | None],  # per row: each request draws from its own stream
) -> torch.Tensor:
    """Per-row `sample_token`: row r uses temperatures[r] and generators[r] -> token ids [N]."""
    tokens = logits.argmax(dim=-1)
    for r, (temperature, generator) in enumerate(zip(temperatures, generators, strict=True)):
        if temperature > 0.0:
            tokens[r] = sample_token(logits[r : r + 1], temperature, generator)[0]
    return tokens
