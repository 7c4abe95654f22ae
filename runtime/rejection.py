"""Speculative verification of a draft chain: the standard acceptance rule (lossless).

Greedy (temperature 0): accept the longest prefix where each draft token equals the target's
argmax; the bonus is the target's argmax after it. Sampling: accept draft token d_j with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw the bonus from the residual
normalise(max(p_j − q_j, 0)); if every draft survives draw the bonus from p_k. The output then
follows the target distribution exactly (Leviathan et al., 2023; Chen et al., 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import draw, probabilities


@dataclass(frozen=True)
class ChainVerdict:
    accepted_drafts: int  # accepted draft tokens a (the acceptance length, bonus included, is a + 1)
    bonus: int  # token committed after the accepted drafts


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalise(max(p − q, 0)); p, q [V]. Falls back to p where p ≤ q everywhere (p == q)."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def verify_chain(
    *,
    target_logits: torch.Tensor,  # [k+1, V] target rows for [anchor, d_1..d_k]
    draft_tokens: torch.Tensor,  # [k]
    draft_logits: torch.Tensor,  # [k, V] the (Markov-corrected) logits each draft was drawn from
    temperature: float,
    generator: torch.Generator | None = None,
) -> ChainVerdict:
    k = draft_tokens.shape[0]
    if temperature == 0.0:
        target_argmax = target_logits.argmax(dim=-1)
        matches = (draft_tokens == target_argmax[:k]).long()
        accepted = int(matches.cumprod(0).sum())
        return ChainVerdict(accepted, int(target_argmax[accepted]))
    p = probabilities(target_logits, temperature)
    q = probabilities(draft_logits, temperature)
    uniforms = torch.rand(k, generator=generator)
    for j in range(k):
        token = int(draft_tokens[j])
        if uniforms[j] * q[j, token] < p[j, token]:  # u < p/q without dividing by a tiny q
            continue
        return ChainVerdict(j, int(draw(residual_distribution(p[j], q[j]), generator)))
    return ChainVerdict(k, int(draw(p[k], generator)))
