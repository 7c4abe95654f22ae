"""Turning logits into distributions and tokens (greedy when temperature is 0), and the seeds of a request's
draws.

A sampled request's generator is re-seeded at the start of every round from its seed and the number of tokens it
has committed (`round_seed`). Where a request stands (seed, tokens so far) is then its whole RNG state: a snapshot,
a swapped-out request or one resumed on another engine carries no generator state, and still draws what it would
have drawn. Within a round the draws follow one stream in a fixed order, as before.
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1


def round_seed(seed: int, committed: int) -> int:
    """The seed of the round that follows a request's first `committed` output tokens (splitmix64 of the pair:
    nearby seeds and counts give unrelated streams)."""
    x = (seed + 0x9E3779B97F4A7C15 * (committed + 1)) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def round_generator(seed: int, committed: int = 0) -> torch.Generator:
    """A generator at the start of that round."""
    return torch.Generator().manual_seed(round_seed(seed, committed))


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] at `temperature` (> 0), computed in float32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V] (unnormalised weights >= 0 allowed) -> ids [...]: the first index whose
    cumulative weight exceeds a uniform draw times the total, so a token of weight 0 is never drawn. One
    uniform per row from `generator`; ~6x cheaper than torch.multinomial for one draw (measured at V = 4096 on
    this CPU: 14 µs against 92 µs a call, the largest host cost of a sampled step)."""
    cdf = probs.float().cumsum(dim=-1)
    u = torch.rand((*cdf.shape[:-1], 1), generator=generator) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


def sample_token(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [N, V] -> token ids [N]; argmax (first maximum) when temperature == 0."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    return draw(probabilities(logits, temperature), generator)


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
