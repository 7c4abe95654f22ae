"""Acceptance of the drafters, measured with the reference decoder on full blocks (greedy).

Three drafters on the same prompts: DSpark, the same DSpark drafter with its Markov head skipped
(drafting from the backbone's logits alone: what the Markov head buys), and DFlash (the
baseline drafter, trained without a Markov head). Every round verifies the whole block, so
position k's conditional acceptance P(draft k accepted | drafts 1..k-1 accepted) is measured
at every position; the mean accepted length counts the bonus token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark.models import DSparkDrafter, TargetModel, load_pair
from dspark.runtime.reference_decoder import RoundStats, speculative_generate
from dspark.tools.demo_eval import summarize

from .subjects import without_markov


def drafter_acceptance(target: TargetModel, drafter: DSparkDrafter, prompts: Sequence[list[int]], *,
                       max_new_tokens: int, stop: int) -> dict[str, Any]:
    rounds: list[RoundStats] = []
    for prompt in prompts:
        rounds += speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens,
                                       stop_token_ids=(stop,)).rounds
    gamma = drafter.config.block_size
    summary = summarize(rounds, gamma)
    summary.pop("confidence", None)  # calibration is `dspark train`'s report, not the bench's
    # rounds whose drafts 1..k-1 were all accepted: the sample size behind position k's rate
    summary["position_samples"] = [sum(r.accepted_drafts >= k - 1 for r in rounds) for k in range(1, gamma + 1)]
    return {"block_size": gamma, **summary}


def acceptance_study(target_dir: Path, target: TargetModel, dspark: DSparkDrafter, dflash_dir: Path | None,
                     prompts: Sequence[list[int]], *, max_new_tokens: int, stop: int) -> dict[str, Any]:
    """{drafter name: summary}; a drafter that cannot be had is {"status": "skipped: ..."}.
    `target` is loaded for `dspark`'s context layers; DFlash gets its own (its layers may differ)."""
    pairs: dict[str, tuple[TargetModel, DSparkDrafter] | str] = {"DSpark": (target, dspark)}
    pairs["DSpark, Markov head off"] = ((target, without_markov(dspark)) if dspark.markov_head is not None
                                        else "skipped: this drafter has no Markov head")
    pairs["DFlash"] = (load_pair(target_dir, dflash_dir) if dflash_dir is not None
                       else "skipped: no DFlash drafter (give --dflash DIR)")
    return {name: ({"status": p} if isinstance(p, str) else
                   {"status": "ok", **drafter_acceptance(*p, prompts, max_new_tokens=max_new_tokens, stop=stop)})
            for name, p in pairs.items()}
