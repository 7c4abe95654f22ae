"""The proposer: drafter backbone output -> draft tokens through the sequential heads.

The backbone gives every block slot in one forward; the Markov head then walks the slots left
to right, each slot's bias conditioned on the token sampled at the previous slot (the anchor
for slot 0). The corrected logits are kept: they are the draft distribution q that the
rejection sampler needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark.models import DSparkDrafter

from .sampling import sample_rows, sample_token


@dataclass
class DraftBlock:
    """B = batch, γ = block size, V = vocab."""

    tokens: torch.Tensor  # [B, γ] draft token of each slot (slot k predicts position start+k+1)
    logits: torch.Tensor  # [B, γ, V] Markov-corrected logits each token was drawn from
    confidence_logits: torch.Tensor | None  # [B, γ] pre-sigmoid survival logits, or None


@torch.no_grad()
def propose_block(
    drafter: DSparkDrafter,
    hidden: torch.Tensor,  # [B, γ, H] backbone output
    anchor: torch.Tensor,  # [B] last committed token
    temperature: float,
    generator: torch.Generator | None = None,
) -> DraftBlock:
    base = drafter.base_logits(hidden)
    state = drafter.initial_head_state(hidden[:, 0])
    prev = anchor
    tokens, logits, confidences = [], [], []
    for k in range(hidden.shape[1]):
        step_logits, confidence, state = drafter.head_step(
            hidden=hidden[:, k], base_logits=base[:, k], prev_ids=prev, state=state
        )
        prev = sample_token(step_logits, temperature, generator)
        tokens.append(prev)
        logits.append(step_logits)
        confidences.append(confidence)
    return DraftBlock(
        tokens=torch.stack(tokens, dim=1),
        logits=torch.stack(logits, dim=1),
        confidence_logits=None if drafter.confidence_head is None else torch.stack(confidences, dim=1),
    )


def propose_rows(
    run_head: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None,
    *,
    hidden: torch.Tensor,  # [R, γ, H] backbone output
    base_logits: torch.Tensor,  # [R, γ, V]
    anchors: torch.Tensor,  # [R] last committed tokens
    feed_base_logits: bool,  # the head graph takes base_logits (LM head placed in the backbone)
    state_size: int,  # recurrent head state width (0: stateless head, no `state` feed)
    temperatures: list[float],  # per request
    generators: list[torch.Generator | None],  # per request
) -> DraftBlock:
    """`propose_block` for a batch of requests through the `drafter_head_step` graph (feeds and
    outputs as in `dspark.export.contract.head_step_spec`); `run_head=None` is a DFlash drafter
    drafting straight from the base logits. Each request samples with its own temperature and
    random stream, in the reference decoder's order."""
    rows = hidden.shape[0]
    state = torch.zeros(rows, state_size, dtype=hidden.dtype)
    prev = anchors
    tokens, logits, confidences = [], [], []
    for k in range(hidden.shape[1]):
        if run_head is None:
            out = {"logits": base_logits[:, k]}
        else:
            feeds = {"hidden": hidden[:, k].contiguous(), "prev_ids": prev}
            if feed_base_logits:
                feeds["base_logits"] = base_logits[:, k].contiguous()
            if state_size:
                feeds["state"] = state
            out = run_head(feeds)
            state = out.get("next_state", state)
        prev = sample_rows(out["logits"], temperatures, generators)
        tokens.append(prev)
        logits.append(out["logits"])
        confidences.append(out.get("confidence_logit"))
    return DraftBlock(
        tokens=torch.stack(tokens, dim=1),
        logits=torch.stack(logits, dim=1),
        confidence_logits=None if confidences[0] is None else torch.stack(confidences, dim=1),
    )
