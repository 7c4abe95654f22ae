"""Tree decoding at temperature 1 follows the target distribution (distribution matching).

Vocab 8, block 3, 6-node best-first trees: over fixed seeds, the 2nd and 3rd generated tokens (the
first comes from the prefill; these come from tree rounds, through accepted nodes, rejections and
bonus draws) are compared with their exact target probabilities by a chi-square test, for
best-first trees (one-hot draft rows) and sampled trees (without-replacement rows). A wrong
rule (declaring the deterministic tree's children as drawn i.i.d. from a uniform draft) must fail
the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_pair
from scipy import stats

from dspark.plugins import child_draft_probs
from dspark.runtime import tree_verifier
from dspark.runtime.tree_decoder import tree_generate

V, PROMPT = 8, [1, 5, 2, 7, 3]


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only contend
    yield random_pair(7, {"vocab_size": V, "num_hidden_layers": 2},
                      {"block_size": 3, "target_layer_ids": (0,), "num_target_layers": 2}, scale=12.0)
    torch.set_num_threads(threads)


@torch.no_grad()
def exact_second_third(target) -> np.ndarray:
    """P(t2, t3) = Σ_t1 p(t1) p(t2 | t1) p(t3 | t1, t2) from one batched forward. -> [V, V]"""
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # (t1, t2)
    ids = torch.cat((torch.tensor(PROMPT).expand(V * V, -1), grid), dim=1)
    probs = torch.softmax(target(ids, torch.arange(ids.shape[1]).expand(V * V, -1)).logits.double(), dim=-1)
    p1 = probs[0, len(PROMPT) - 1]  # [V]
    p2 = probs[:, len(PROMPT)].reshape(V, V, V)[:, 0]  # [t1, t2]: row t1 (any t2 column)
    p3 = probs[:, len(PROMPT) + 1].reshape(V, V, V)  # [t1, t2, t3]
    return torch.einsum("a,ab,abc->bc", p1, p2, p3).numpy()


def pvalue(target, drafter, trials: int, draw: str = "best_first") -> tuple[float, list[int]]:
    """-> chi-square p-value, accepted draft nodes of every round."""
    counts, accepted = np.zeros((V, V)), []
    for seed in range(trials):
        tokens = tree_generate(target, drafter, PROMPT, max_new_tokens=3, num_nodes=6, temperature=1.0,
                               draw=draw, seed=seed, observer=lambda s, _: accepted.append(s.accepted_drafts)).tokens
        counts[tokens[1], tokens[2]] += 1
    expected = exact_second_third(target).ravel() * trials
    observed = counts.ravel()
    small = expected < 5  # pool the rare cells into one
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    return float(stats.chisquare(observed, expected).pvalue), accepted


def test_tree_sampling_matches_the_target_distribution(pair) -> None:
    p, accepted = pvalue(*pair, trials=1000)
    assert p > 1e-3
    rates = np.bincount(accepted, minlength=3) / len(accepted)
    assert rates[0] > 0.05 and rates[1] > 0.05 and rates[2] > 0.005, f"acceptance mix {rates}"


def test_the_check_rejects_a_wrong_acceptance_rule(pair, monkeypatch) -> None:
    def uniform_iid(*, parents, draft_tokens, parent_probs, process):
        return child_draft_probs(parents=parents, draft_tokens=draft_tokens,
                                 parent_probs=torch.full_like(parent_probs, 1.0 / V), process="iid")

    monkeypatch.setattr(tree_verifier, "child_draft_probs", uniform_iid)
    assert pvalue(*pair, trials=400)[0] < 1e-6


def test_sampled_trees_match_the_target_distribution(pair) -> None:
    p, accepted = pvalue(*pair, trials=600, draw="sampled")
    assert p > 1e-3
    assert np.mean(np.asarray(accepted) > 0) > 0.2, "sampled trees should accept drafts"
