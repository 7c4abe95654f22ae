"""Temperature sampling through speculative decoding follows the target's exact distribution.

On an 8-token vocabulary the exact joint law of the first three generated tokens is enumerated
from the target; thousands of seeded speculative runs must match it (chi-square). The same
test with a deliberately wrong acceptance rule — resampling rejected positions from p instead
of the residual max(p − q, 0) — must fail, which shows the test has the power to catch it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import random_pair

from dspark.runtime import rejection
from dspark.runtime.reference_decoder import speculative_generate

scipy_stats = pytest.importorskip("scipy.stats", reason="scipy is a test-only dependency (pip install .[dev])")

VOCAB, NEW_TOKENS, RUNS = 8, 3, 1500
PROMPT = [1, 2, 3]


pytestmark = pytest.mark.usefixtures("one_thread")


def _pair():
    target, drafter = random_pair(
        3,
        target_overrides=dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=8),
        drafter_overrides=dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                               block_size=3, target_layer_ids=(-1, 0), markov_rank=2),
        scale=40.0,
    )
    return target, drafter


@torch.no_grad()
def _exact_joint(target, temperature: float) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) for every triple, [V, V, V]."""
    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor([PROMPT + p for p in prefixes])
        logits = target(ids, torch.arange(ids.shape[1]).expand_as(ids)).logits[:, -1]
        return torch.softmax(logits / temperature, dim=-1)

    p1 = next_probs([[]])[0]
    p2 = next_probs([[a] for a in range(VOCAB)])  # [V, V]
    pairs = list(itertools.product(range(VOCAB), repeat=2))
    p3 = next_probs([list(p) for p in pairs]).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi_square_pvalue(target, drafter, temperature: float) -> float:
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    for seed in range(RUNS):
        tokens = speculative_generate(target, drafter, PROMPT, max_new_tokens=NEW_TOKENS,
                                      temperature=temperature, seed=seed).tokens
        counts[tuple(tokens)] += 1
    expected = _exact_joint(target, temperature).flatten() * RUNS
    observed = counts.flatten()
    # Pool the rare cells so every chi-square bin expects at least 5 samples.
    rare = expected < 5
    obs = torch.cat((observed[~rare], observed[rare].sum()[None]))
    exp = torch.cat((expected[~rare], expected[rare].sum()[None]))
    exp = exp * obs.sum() / exp.sum()
    return float(scipy_stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


@pytest.mark.slow
def test_speculative_sampling_matches_target_distribution():
    target, drafter = _pair()
    assert _chi_square_pvalue(target, drafter, temperature=1.0) > 1e-3


@pytest.mark.slow
def test_wrong_acceptance_rule_is_detected(monkeypatch):
    target, drafter = _pair()
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    assert _chi_square_pvalue(target, drafter, temperature=1.0) < 1e-6
