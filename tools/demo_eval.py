"""Acceptance of the demo drafters on the held-out stdlib modules, with the reference decoder.

For every (drafter, temperature) it records each verify round, then reports the mean accepted
length (bonus token included), the position-wise conditional acceptance P(draft k accepted |
drafts 1..k-1 accepted) as in the paper's Fig. 2, and for a confidence head its AUC and ECE
against the same conditional events (σ(c_k) predicts "draft k survives given its prefix did").
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dspark.models import DSparkDrafter, TargetModel
from dspark.runtime.reference_decoder import RoundStats, autoregressive_generate, speculative_generate


def heldout_prompts(
    stream_per_module: Sequence[torch.Tensor], per_module: int, prompt_len: int
) -> list[list[int]]:
    """`per_module` prompts of `prompt_len` tokens at evenly spaced offsets of each module."""
    prompts = []
    for ids in stream_per_module:
        span = ids.numel() - prompt_len
        if span <= 0:
            continue
        for i in range(per_module):
            start = span * i // per_module
            prompts.append(ids[start : start + prompt_len].tolist())
    return prompts


@torch.no_grad()
def heldout_loss(target: TargetModel, streams: Sequence[torch.Tensor], length: int = 256) -> dict[str, float]:
    """Next-token cross-entropy (nats/token) and perplexity over non-overlapping windows of each
    held-out module (a module's tail shorter than a window is scored as one shorter window)."""
    total, count = 0.0, 0
    target.eval()
    for ids in streams:
        for start in range(0, ids.numel() - 1, length):
            window = ids[start : start + length + 1]
            if window.numel() < 2:
                continue
            inputs = window[None, :-1]
            logits = target(inputs, torch.arange(inputs.shape[1])[None]).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum"))
            count += window.numel() - 1
    loss = total / count
    return {"tokens": count, "loss": round(loss, 4), "perplexity": round(math.exp(loss), 2)}


def conditional_events(rounds: Sequence[RoundStats], gamma: int) -> list[tuple[int, float | None, bool]]:
    """(position k ≥ 1, confidence logit or None, accepted) for each draft whose prefix survived."""
    events = []
    for r in rounds:
        for k in range(1, min(r.proposal_length, gamma) + 1):
            if r.accepted_drafts < k - 1:
                break
            conf = None if r.confidence_logits is None else r.confidence_logits[k - 1]
            events.append((k, conf, r.accepted_drafts >= k))
    return events


def roc_auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Mann-Whitney AUC with tied scores counted half; None when one class is absent."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return None
    ranked = sorted((s, y) for s, y in zip(scores, labels, strict=True))
    rank_sum, i = 0.0, 0
    while i < len(ranked):
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        mid_rank = (i + j + 1) / 2  # 1-based average rank of the tie group
        rank_sum += mid_rank * sum(1 for _, y in ranked[i:j] if y)
        i = j
    return (rank_sum - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def expected_calibration_error(probs: Sequence[float], labels: Sequence[bool], bins: int = 10) -> float:
    """Σ_b |B_b|/N · |mean(p) − mean(y)| over equal-width probability bins."""
    total, err = len(probs), 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        members = [(p, y) for p, y in zip(probs, labels, strict=True)
                   if lo <= p < hi or (b == bins - 1 and p == 1)]
        if members:
            gap = sum(p for p, _ in members) / len(members) - sum(y for _, y in members) / len(members)
            err += len(members) / total * abs(gap)
    return err


def reliability(probs: Sequence[float], labels: Sequence[bool], bins: int = 10) -> list[dict[str, float]]:
    rows = []
    for b in range(bins):
        members = [(p, y) for p, y in zip(probs, labels, strict=True) if b / bins <= p < (b + 1) / bins]
        if members:
            rows.append({"mean_confidence": sum(p for p, _ in members) / len(members),
                         "accept_rate": sum(y for _, y in members) / len(members), "count": len(members)})
    return rows


def summarize(rounds: Sequence[RoundStats], gamma: int) -> dict[str, Any]:
    events = conditional_events(rounds, gamma)
    by_position = []
    for k in range(1, gamma + 1):
        outcomes = [acc for pos, _, acc in events if pos == k]
        by_position.append(sum(outcomes) / len(outcomes) if outcomes else None)
    summary: dict[str, Any] = {
        "rounds": len(rounds),
        "mean_acceptance_length": sum(r.acceptance_length for r in rounds) / len(rounds),
        "conditional_acceptance": by_position,
    }
    scored = [(conf, acc) for _, conf, acc in events if conf is not None]
    if scored:
        probs = [float(torch.sigmoid(torch.tensor(c))) for c, _ in scored]
        labels = [acc for _, acc in scored]
        summary["confidence"] = {
            "events": len(scored),
            "auc": roc_auc(probs, labels),
            "ece": expected_calibration_error(probs, labels),
            "reliability": reliability(probs, labels),
        }
    return summary


def evaluate_drafter(
    target: TargetModel,
    drafter: DSparkDrafter,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float,
    new_tokens: int,
    seed: int = 0,
) -> dict[str, Any]:
    rounds: list[RoundStats] = []
    tokens = 0
    began = time.perf_counter()
    for i, prompt in enumerate(prompts):
        result = speculative_generate(target, drafter, prompt, max_new_tokens=new_tokens,
                                      temperature=temperature, seed=seed + i)
        rounds.extend(result.rounds)
        tokens += len(result.tokens)
    seconds = time.perf_counter() - began
    summary = summarize(rounds, drafter.config.block_size)
    summary.update(_speed(tokens, seconds))
    return summary


def evaluate_autoregressive(
    target: TargetModel,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float,
    new_tokens: int,
    seed: int = 0,
) -> dict[str, Any]:
    began, tokens = time.perf_counter(), 0
    for i, prompt in enumerate(prompts):
        tokens += len(autoregressive_generate(target, prompt, max_new_tokens=new_tokens,
                                              temperature=temperature, seed=seed + i))
    seconds = time.perf_counter() - began
    return _speed(tokens, seconds)


def _speed(tokens: int, seconds: float) -> dict[str, Any]:
    return {"tokens": tokens, "wall_seconds": round(seconds, 2),
            "tokens_per_second": round(tokens / seconds, 1)}


def plot(results: dict[str, Any], path: Path) -> None:
    """Conditional acceptance per draft position and the confidence reliability diagram."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, run in results["runs"].items():
        values = run["conditional_acceptance"]
        positions = [k + 1 for k, v in enumerate(values) if v is not None]
        style = "-" if key.startswith("dspark") else "--"
        left.plot(positions, [v for v in values if v is not None], style, marker="o",
                  label=f"{key} (τ={run['mean_acceptance_length']:.2f})")
    left.set(xlabel="draft position k", ylabel="P(accept k | 1..k-1 accepted)",
             title="Position-wise conditional acceptance", ylim=(0, 1.02))
    left.legend(fontsize=8)
    right.plot([0, 1], [0, 1], color="grey", linewidth=0.8)
    for key, run in results["runs"].items():
        if "confidence" in run:
            rows = run["confidence"]["reliability"]
            right.plot([r["mean_confidence"] for r in rows], [r["accept_rate"] for r in rows], marker="o",
                       label=f"{key} AUC {run['confidence']['auc']:.3f} ECE {run['confidence']['ece']:.3f}")
    right.set(xlabel="σ(confidence)", ylabel="observed acceptance", title="Confidence head reliability",
              xlim=(0, 1), ylim=(0, 1))
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
