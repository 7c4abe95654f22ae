"""Verification of every request's draft chain in one step: tensors in, accepted counts out.

Greedy rows (temperature 0) are decided together: a draft token survives while it equals the
target's argmax at its position and every earlier one survived; the bonus is the argmax after the
last survivor. Sampling rows run the standard rejection rule (`rejection.verify_chain`) each on
its own random stream. Either way the output follows the target exactly (greedy: it is the
target's own argmax chain).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .rejection import verify_chain
from .step_batch import StepBatch


def verify_chains(
    batch: StepBatch,  # ids [R, W]: anchor then the drafts under verification
    target_logits: np.ndarray,  # [R, W, V] the target's logits at those tokens
    greedy_ids: np.ndarray | None,  # [R, W] their argmax when the graph computed it, else None
    draft_logits: np.ndarray | torch.Tensor | None,  # [R, γ, V] what each draft was drawn from
    temperatures: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> tuple[np.ndarray, np.ndarray]:
    """-> accepted drafts [R] int64 (0 .. counts - 1) and the bonus token of each row [R] int64."""
    drafts = batch.counts - 1
    greedy = target_logits.argmax(axis=-1) if greedy_ids is None else greedy_ids  # [R, W]
    sampled = [r for r, t in enumerate(temperatures) if t > 0]
    if batch.width == 1 and not sampled:  # anchors only, all greedy (plain decoding): the bonus is the argmax
        return np.zeros(batch.rows, np.int64), greedy[:, 0].astype(np.int64)
    if batch.rows == 1 and not sampled:  # one greedy row: its drafts walked in Python, no [R, W] masks
        ids, best, n, k = batch.ids[0].tolist(), greedy[0].tolist(), int(drafts[0]), 0
        while k < n and ids[k + 1] == best[k]:
            k += 1
        return np.array([k], np.int64), np.array([best[k]], np.int64)
    survives = (batch.ids[:, 1:] == greedy[:, :-1]) & (np.arange(batch.width - 1)[None, :] < drafts[:, None])
    accepted = np.cumprod(survives, axis=1).sum(axis=1) if batch.width > 1 else np.zeros(batch.rows, np.int64)
    bonus = greedy[np.arange(batch.rows), accepted]  # a copy: the sampling rows below overwrite theirs
    for r in sampled:
        k = int(drafts[r])
        verdict = verify_chain(
            target_logits=torch.from_numpy(target_logits[r, : k + 1]),
            draft_tokens=torch.from_numpy(batch.ids[r, 1 : 1 + k]),
            draft_logits=torch.as_tensor(draft_logits[r, :k]) if k else torch.from_numpy(target_logits[r, :0]),
            temperature=temperatures[r], generator=generators[r],
        )
        accepted[r], bonus[r] = verdict.accepted_drafts, verdict.bonus
    return accepted.astype(np.int64), bonus.astype(np.int64)
