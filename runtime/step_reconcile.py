"""Reconcile: what a verified step leaves in the caches and the requests (the batch loop's last phase).

After verification each row keeps its accepted drafts and the bonus token: the target's KV entries are committed
at each row's own length (rollback is not counting the rest), the new context rows go to the drafter (the context
log's while no row drafts, `context_log`), and each request's tokens and per-step lengths grow. A step that
verified anchors only, every row greedy (plain decoding, a declined step), takes the short way: each row gains the
target's argmax.
"""

from __future__ import annotations

import numpy as np
import torch

from .chain_verifier import verify_chains
from .context_log import ContextLog
from .prefix_scheduler import SchedulerConfig
from .request_state import RunningRequest
from .step_batch import StepBatch
from .target_runner import TargetRunner


class StepReconcile:
    """Mixed into `BatchEngine` (its target runner, scheduler, context log and active rows)."""

    target: TargetRunner
    scheduler: SchedulerConfig
    context_log: ContextLog
    active: list[RunningRequest]

    def _commit_anchors(self, batch: StepBatch, out) -> list[int]:
        """A step that verified anchors only, every row greedy (plain decoding, a declined step): each row
        gains the target's argmax; the drafter's context rows are kept where it may draft later."""
        greedy = out.logits[:, 0].argmax(axis=-1) if out.greedy_ids is None else out.greedy_ids[:, 0]
        self.target.commit(batch.counts)
        if self.scheduler.needs_drafts:  # [R, F]: the buffer is the next step's
            self.context_log.log(out.context_features[: batch.rows, 0], self.active)
        for a, token in zip(self.active, greedy.tolist(), strict=True):
            a.result.tokens.append(token)
            a.result.acceptance_lengths.append(1)
            a.result.proposal_lengths.append(0)
            a.start += 1
            a.anchor = token
        return [1] * batch.rows

    def _reconcile(self, batch: StepBatch, out, block, temperatures: list[float],
                   generators: list[torch.Generator | None]) -> list[int]:
        """Accept, commit the accepted KV entries, hand the new context rows to the drafter, and
        append each request's tokens."""
        if batch.width == 1 and not any(temperatures):
            return self._commit_anchors(batch, out)
        drafts, bonus = verify_chains(batch, out.logits, out.greedy_ids, None if block is None else block.logits,
                                      temperatures, generators)
        kept = drafts + 1
        self.target.commit(kept)
        if self.scheduler.needs_drafts:  # rows the drafter has not seen yet (several steps' if it skipped)
            self.context_log.hand(self.active)
            context = batch.gather(out.context_features, kept)
            # one row each (no draft accepted: most steps under load) needs no cumulative sum
            cu = range(len(kept) + 1) if len(context) == len(kept) else [0, *np.cumsum(kept).tolist()]
            for r, a in enumerate(self.active):
                a.add_context(context[cu[r] : cu[r + 1]])
        ids, kept_list, bonus_list = batch.ids.tolist(), kept.tolist(), bonus.tolist()
        lengths = (batch.counts - 1).tolist()
        for a, row, n, b, k in zip(self.active, ids, kept_list, bonus_list, lengths, strict=True):
            a.result.tokens += row[1:n]
            a.result.tokens.append(b)
            a.result.acceptance_lengths.append(n)
            a.result.proposal_lengths.append(k)
            a.start += n
            a.anchor = b
        return kept_list
