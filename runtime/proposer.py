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

from .sampling import sample_rows


@dataclass
class DraftBlock:
    """B = batch, γ = block size, V = vocab."""

    tokens: torch.Tensor  # [B, γ] draft token of each slot (slot k predicts position start+k+1)
    logits: torch.Tensor | None  # [B, γ, V] Markov-corrected logits each token was drawn from (None: all greedy)
    confidence_logits: torch.Tensor | None  # [B, γ] pre-sigmoid survival logits, or None


# feeds -> outputs of one sequential-head slot, named as `dspark.export.contract.head_step_spec`
HeadStep = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def propose_rows(
    run_head: HeadStep | None,
    *,
    hidden: torch.Tensor,  # [R, γ, H] backbone output
    base_logits: torch.Tensor,  # [R, γ, V]
    anchors: torch.Tensor,  # [R] last committed tokens
    feed_base_logits: bool,  # the head graph takes base_logits (LM head placed in the backbone)
    state_size: int,  # recurrent head state width (0: stateless head, no `state` feed)
    temperatures: list[float],  # per request
    generators: list[torch.Generator | None],  # per request
) -> DraftBlock:
    """Walk the block's slots through the sequential head, one call per slot for all requests:
    `run_head` is the `drafter_head_step` graph (or `torch_head_step` of a PyTorch drafter);
    `None` is a DFlash drafter drafting straight from the base logits. Each request samples with
    its own temperature and random stream."""
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


def torch_head_step(drafter: DSparkDrafter) -> HeadStep:
    """`drafter.head_step` behind the `drafter_head_step` graph's feeds and outputs."""

    def run(feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits, confidence, state = drafter.head_step(
            hidden=feeds["hidden"], base_logits=feeds["base_logits"], prev_ids=feeds["prev_ids"],
            state=feeds.get("state"),
        )
        out = {"logits": logits}
        if confidence is not None:
            out["confidence_logit"] = confidence
        if state is not None:
            out["next_state"] = state
        return out

    return run


@torch.no_grad()
def propose_block(
    drafter: DSparkDrafter,
    hidden: torch.Tensor,  # [B, γ, H] backbone output
    anchor: torch.Tensor,  # [B] last committed token
    temperature: float,
    generator: torch.Generator | None = None,
) -> DraftBlock:
    """`propose_rows` with the PyTorch drafter's heads, one temperature and one random stream for
    every row (the reference decoders' case)."""
    initial_state = drafter.initial_head_state(hidden[:, 0])  # None, or zeros [B, r] (RNN head)
    rows = hidden.shape[0]
    return propose_rows(
        torch_head_step(drafter),
        hidden=hidden,
        base_logits=drafter.base_logits(hidden),
        anchors=anchor,
        feed_base_logits=True,
        state_size=0 if initial_state is None else initial_state.shape[1],
        temperatures=[temperature] * rows,
        generators=[generator] * rows,
    )
