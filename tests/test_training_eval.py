"""The held-out evaluation metrics: conditional acceptance events, AUC and ECE."""

from __future__ import annotations

import random

import pytest

from dspark.runtime.reference_decoder import RoundStats
from dspark.tools.demo_eval import conditional_events, expected_calibration_error, roc_auc, summarize


def _round(accepted: int, confidences: list[float] | None, gamma: int = 4) -> RoundStats:
    return RoundStats(start=0, anchor=0, draft_tokens=[0] * gamma, proposal_length=gamma,
                      accepted_drafts=accepted, acceptance_length=accepted + 1, confidence_logits=confidences)


def test_conditional_events_stop_after_the_first_rejection() -> None:
    events = conditional_events([_round(1, [0.1, 0.2, 0.3, 0.4]), _round(4, None)], gamma=4)
    assert events == [(1, 0.1, True), (2, 0.2, False), (1, None, True), (2, None, True), (3, None, True),
                      (4, None, True)]
    summary = summarize([_round(1, None), _round(4, None), _round(0, None)], gamma=4)
    assert summary["mean_acceptance_length"] == pytest.approx((2 + 5 + 1) / 3)
    assert summary["conditional_acceptance"] == [pytest.approx(2 / 3), 0.5, 1.0, 1.0]


def test_auc_matches_pairwise_definition() -> None:
    rng = random.Random(0)
    scores = [round(rng.random(), 1) for _ in range(60)]  # rounded: plenty of ties
    labels = [rng.random() < s for s in scores]
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    pairwise = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))
    assert roc_auc(scores, labels) == pytest.approx(pairwise)
    assert roc_auc([0.1, 0.2], [True, True]) is None


def test_ece_is_zero_when_calibrated_and_the_gap_otherwise() -> None:
    assert expected_calibration_error([0.25] * 4, [True, False, False, False]) == pytest.approx(0.0)
    assert expected_calibration_error([0.95] * 4, [True, False, True, False]) == pytest.approx(0.45)
