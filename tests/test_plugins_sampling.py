"""Distribution matching for TreeAcceptSampling: the emitted tokens follow the target, per draft process.

Tree (N = 10): the root has 3 children, each child has 2 children. Target and draft distributions
at a node depend only on that node's token, so the emitted sequence must follow p0 for the first
token and P2[x] for the token after an accepted x. Fixed seeds; V = 6, 20k trials per process.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from dspark import plugins
from dspark.plugins.tree_accept.reference import sample_from, tree_accept_sampling

V, TRIALS = 6, 20_000
PARENTS = np.array([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3])
CHILD_SLOTS, GRANDCHILD_SLOTS = [1, 2, 3], [[4, 5], [6, 7], [8, 9]]
TABLES = np.random.default_rng(11)
P0, Q0 = TABLES.dirichlet(np.ones(V)), TABLES.dirichlet(np.ones(V))
P2, Q2 = TABLES.dirichlet(2 * np.ones(V), size=V), TABLES.dirichlet(np.ones(V), size=V)


def draw(rng: np.random.Generator, q: np.ndarray, k: int, process: str) -> np.ndarray:
    """k children tokens per row from q [B, V]: i.i.d., without replacement, or the top-k."""
    if process == "iid":
        return (q.cumsum(-1)[:, None, :] < rng.random((len(q), k, 1))).sum(-1).clip(max=V - 1)
    if process == "without_replacement":  # Gumbel top-k = sequential sampling without replacement
        return np.argsort(-(np.log(q) + rng.gumbel(size=q.shape)), axis=-1)[:, :k]
    return np.argsort(-q, axis=-1, kind="stable")[:, :k]


def draft_trees(rng: np.random.Generator, process: str) -> dict[str, np.ndarray]:
    tokens = np.zeros((TRIALS, len(PARENTS)), dtype=np.int64)
    tokens[:, CHILD_SLOTS] = draw(rng, np.tile(Q0, (TRIALS, 1)), 3, process)
    for child, grandchildren in zip(CHILD_SLOTS, GRANDCHILD_SLOTS, strict=True):
        tokens[:, grandchildren] = draw(rng, Q2[tokens[:, child]], 2, process)
    parents = np.tile(PARENTS, (TRIALS, 1))
    target = P2[tokens]  # [B, N, V]: a node's target row depends on its token
    target[:, 0] = P0
    parent_q = Q2[tokens]
    parent_q[:, 0] = Q0
    draft = plugins.child_draft_probs(parents=parents, draft_tokens=tokens, parent_probs=parent_q, process=process)
    return {"parents": parents, "draft_tokens": tokens, "target_probs": target, "draft_probs": draft}


def emitted(result, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First emitted token per trial, and (first, second) for trials that accepted a draft token."""
    rows = np.arange(TRIALS)
    accepted = result.accept_length > 1
    first = np.where(accepted, tokens[rows, result.accepted_path[:, 1]], result.bonus_token)
    deeper = result.accept_length > 2
    second = np.where(deeper, tokens[rows, result.accepted_path[:, 2]], result.bonus_token)
    return first, np.stack([first[accepted], second[accepted]], axis=1)


def first_token_pvalue(first: np.ndarray) -> float:
    return stats.chisquare(np.bincount(first, minlength=V), P0 * len(first)).pvalue


def second_token_pvalue(pairs: np.ndarray) -> float:
    statistic, dof = 0.0, 0
    for x in range(V):
        seconds = pairs[pairs[:, 0] == x, 1]
        if len(seconds) < 100:
            continue
        expected = P2[x] * len(seconds)
        statistic += (((np.bincount(seconds, minlength=V) - expected) ** 2) / expected).sum()
        dof += V - 1
    return stats.chi2.sf(statistic, dof)


@pytest.mark.parametrize("process", ["iid", "without_replacement", "deterministic"])
def test_emitted_tokens_follow_the_target(process):
    rng = np.random.default_rng(5)
    trees = draft_trees(rng, process)
    result = tree_accept_sampling(
        **trees, past_lengths=np.zeros(TRIALS, dtype=np.int64), uniforms=rng.random((TRIALS, 10)), max_depth=2
    )
    first, pairs = emitted(result, trees["draft_tokens"])
    assert 0.2 < np.mean(result.accept_length > 1) < 1.0  # both branches are exercised
    assert first_token_pvalue(first) > 1e-3
    assert second_token_pvalue(pairs) > 1e-3


def without_residual(p: np.ndarray, q: np.ndarray, children: np.ndarray, uniforms: np.ndarray) -> int:
    """A wrong multi-candidate rule: every child is tested against the original p."""
    for x, u in zip(children, uniforms[:-1], strict=True):
        if u < min(1.0, p[x] / q[x]):
            return int(x)
    return sample_from(np.maximum(p - q, 0), uniforms[-1])


def test_the_same_check_rejects_a_rule_without_residual_update():
    rng = np.random.default_rng(5)
    trees = draft_trees(rng, "iid")
    uniforms = rng.random((TRIALS, 4))
    children = trees["draft_tokens"][:, CHILD_SLOTS]
    first = np.array([without_residual(P0, Q0, children[b], uniforms[b]) for b in range(TRIALS)])
    assert first_token_pvalue(first) < 1e-6
