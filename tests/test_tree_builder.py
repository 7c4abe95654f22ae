"""Tree builder: best-first order and budget, Markov conditioning on the parent token, node scheduler."""

from __future__ import annotations

import pytest
import torch
from conftest import random_pair

from dspark.runtime.tree_builder import TreeConfigError, build_tree, node_budgets, sample_tree

V, GAMMA = 8, 3


def small_drafter(head: str = "vanilla", markov_scale: float = 30.0):
    """Vocab 8, block 3; the Markov head's weights are scaled up so the parent token matters."""
    _, drafter = random_pair(3, {"vocab_size": V}, {"block_size": GAMMA, "markov_head_type": head}, scale=20.0)
    with torch.no_grad():
        for p in drafter.markov_head.parameters():
            p.mul_(markov_scale)
    hidden = torch.randn(GAMMA, drafter.config.hidden_size, generator=torch.Generator().manual_seed(5))
    return drafter, hidden


def path_of(tree, node: int) -> list[int]:
    path = []
    while node > 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


@torch.no_grad()
def child_probs(drafter, hidden: torch.Tensor, prefix: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Draft distribution of the token after `prefix` = [anchor, t_1..t_d], by teacher forcing."""
    d = len(prefix) - 1
    logits, _ = drafter.teacher_forced_heads(hidden[None, : d + 1], torch.tensor([prefix]))
    return torch.softmax(logits[0, d].double() / temperature, dim=-1)


def all_prefix_scores(drafter, hidden: torch.Tensor, anchor: int) -> dict[tuple[int, ...], float]:
    """Brute force: the score of every prefix of depth 1..γ."""
    scores, frontier = {}, [((), 1.0)]
    for _ in range(GAMMA):
        nxt = []
        for prefix, score in frontier:
            probs = child_probs(drafter, hidden, [anchor, *prefix])
            for token in range(V):
                nxt.append(((*prefix, token), score * float(probs[token])))
        scores.update(nxt)
        frontier = nxt
    return scores


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_best_first_tree_is_the_top_prefixes_in_order(head: str) -> None:
    drafter, hidden = small_drafter(head)
    anchor, n = 2, 20
    tree = build_tree(drafter, hidden, anchor, num_nodes=n)
    assert tree.num_nodes == n and tree.parents[0] == -1 and tree.tokens[0] == anchor
    assert all(0 <= tree.parents[i] < i for i in range(1, n + 1))
    assert all(a >= b for a, b in zip(tree.scores[1:], tree.scores[2:], strict=False))
    brute = all_prefix_scores(drafter, hidden, anchor)
    built = {tuple(tree.tokens[i] for i in path_of(tree, node)): tree.scores[node] for node in range(1, n + 1)}
    assert len(built) == n  # distinct prefixes: siblings carry distinct tokens
    for prefix, score in built.items():
        assert score == pytest.approx(brute[prefix], rel=1e-6)
    ranked = sorted(brute.values(), reverse=True)
    assert sorted(built.values(), reverse=True) == pytest.approx(ranked[:n], rel=1e-6)
    assert tree.depths == [len(path_of(tree, i)) for i in range(n + 1)]


def test_markov_children_are_conditioned_on_their_parent_token() -> None:
    drafter, hidden = small_drafter()
    anchor = 1
    tree = build_tree(drafter, hidden, anchor, num_nodes=40, top_k=V)
    siblings = [i for i in range(1, tree.num_nodes + 1) if tree.parents[i] == 0][:2]
    rows = []
    for s in siblings:
        kids = [c for c in range(1, tree.num_nodes + 1) if tree.parents[c] == s]
        assert kids, "both siblings should be expanded with a 40-node budget"
        expected = child_probs(drafter, hidden, [anchor, tree.tokens[s]])
        for c in kids:
            assert tree.scores[c] / tree.scores[s] == pytest.approx(float(expected[tree.tokens[c]]), rel=1e-6)
        rows.append(expected)
    assert not torch.allclose(rows[0], rows[1], atol=1e-3), "siblings' children should differ"


def test_marginals_children_ignore_their_parent_token() -> None:
    drafter, hidden = small_drafter()
    anchor = 1
    tree = build_tree(drafter, hidden, anchor, num_nodes=40, top_k=V, mode="marginals")
    chain, ratios = [anchor], {}
    for _ in range(GAMMA):  # the drafter's greedy chain
        chain.append(int(child_probs(drafter, hidden, chain).argmax()))
    for c in range(1, tree.num_nodes + 1):
        p = tree.parents[c]
        expected = child_probs(drafter, hidden, chain[: tree.depths[p] + 1])
        assert tree.scores[c] / tree.scores[p] == pytest.approx(float(expected[tree.tokens[c]]), rel=1e-6)
        ratios.setdefault((tree.depths[c], tree.tokens[c]), set()).add(round(tree.scores[c] / tree.scores[p], 9))
    assert all(len(r) == 1 for r in ratios.values())


def test_budget_depth_and_top_k_limits() -> None:
    drafter, hidden = small_drafter()
    assert build_tree(drafter, hidden, 0, num_nodes=0).num_nodes == 0
    chain = build_tree(drafter, hidden, 0, num_nodes=50, top_k=1)
    assert chain.num_nodes == GAMMA and chain.parents == [-1, 0, 1, 2]
    full = build_tree(drafter, hidden, 0, num_nodes=1000, top_k=2)
    assert full.num_nodes == 2 + 4 + 8 and full.max_depth == GAMMA
    assert build_tree(drafter, hidden, 0, num_nodes=7).truncate(3).num_nodes == 3


def test_builder_rejects_bad_arguments() -> None:
    drafter, hidden = small_drafter()
    with pytest.raises(TreeConfigError, match="tree mode"):
        build_tree(drafter, hidden, 0, num_nodes=4, mode="beam")
    with pytest.raises(TreeConfigError, match="num_nodes"):
        build_tree(drafter, hidden, 0, num_nodes=-1)
    with pytest.raises(TreeConfigError, match=r"\[γ, H\]"):
        build_tree(drafter, hidden[None], 0, num_nodes=4)
    with pytest.raises(TreeConfigError, match="score_temperature"):
        build_tree(drafter, hidden, 0, num_nodes=4, score_temperature=0.0)


def test_node_budget_stops_at_the_first_throughput_drop() -> None:
    def sps(tokens: int) -> float:
        return 1.0 / (1.0 + tokens)

    # B=1, τ=1: Θ=1/2. +0.9 -> 1.9/3 = 0.633 (admit); +0.5 -> 2.4/4 = 0.6 (stop, even though a
    # later, smaller candidate is never looked at).
    decision = node_budgets([[0.9, 0.5, 0.4]], sps)
    assert decision.nodes == (1,) and decision.considered == 2
    assert decision.expected_accepts == pytest.approx(1.9)
    assert decision.expected_throughput == pytest.approx(1.9 / 3)


def test_node_budget_with_free_tokens_admits_every_live_node_up_to_the_cap() -> None:
    decision = node_budgets([[0.9, 0.3, 0.0], [0.8, 0.7]], lambda b: 10.0)
    assert decision.nodes == (2, 2)
    assert node_budgets([[0.9, 0.3, 0.1], [0.8, 0.7]], lambda b: 10.0, max_nodes=1).nodes == (1, 1)


def test_node_budget_admits_across_requests_by_survival() -> None:
    def sps(tokens: int) -> float:  # a step costs 1 + 0.1 per token
        return 1.0 / (1.0 + 0.1 * tokens)

    survivals = [[0.95, 0.9, 0.2, 0.1], [0.85, 0.05]]
    decision = node_budgets(survivals, sps)
    admitted = sorted((a for row, n in zip(survivals, decision.nodes, strict=True) for a in row[:n]), reverse=True)
    rest = [a for row, n in zip(survivals, decision.nodes, strict=True) for a in row[n:]]
    assert max(rest) <= min(admitted)  # admitted = the highest survivals
    tau, tokens = 2 + sum(admitted), 2 + len(admitted)
    assert decision.expected_throughput == pytest.approx(tau * sps(tokens))
    assert (tau + max(rest)) * sps(tokens + 1) <= decision.expected_throughput


def test_node_budget_refuses_unordered_survivals() -> None:
    with pytest.raises(TreeConfigError, match="non-increasing"):
        node_budgets([[0.5, 0.6]], lambda b: 1.0)


def test_sampled_tree_keeps_the_shape_and_draws_distinct_siblings() -> None:
    drafter, hidden = small_drafter()
    shape = build_tree(drafter, hidden, 1, num_nodes=12)
    generator = torch.Generator().manual_seed(0)
    # The scaled-up test drafter is very peaked: a high temperature makes the draws vary.
    trees = [sample_tree(drafter, hidden, shape, temperature=30.0, generator=generator) for _ in range(20)]
    for tree in trees:
        assert tree.parents == shape.parents and tree.depths == shape.depths and tree.tokens[0] == 1
        for u in range(tree.num_nodes + 1):
            kids = [tree.tokens[c] for c in range(1, tree.num_nodes + 1) if tree.parents[c] == u]
            assert len(set(kids)) == len(kids)
            if kids:  # q_u is conditioned on u's own sampled token (markov mode)
                prefix = [tree.tokens[i] for i in [0, *path_of(tree, u)]]
                torch.testing.assert_close(tree.child_probs[u], child_probs(drafter, hidden, prefix, 30.0))
    assert len({tuple(t.tokens) for t in trees}) > 1
    with pytest.raises(TreeConfigError, match="temperature > 0"):
        sample_tree(drafter, hidden, shape, temperature=0.0)


@pytest.mark.parametrize("per_token", [0.01, 0.05, 0.2])
def test_online_node_scheduler_equals_truncating_the_full_tree(per_token: float) -> None:
    drafter, hidden = small_drafter(markov_scale=1.0)
    hidden = hidden / 20.0  # flatter distributions: a spread of survivals

    def sps(tokens: int) -> float:
        return 1.0 / (1.0 + per_token * tokens)

    full = build_tree(drafter, hidden, 3, num_nodes=30)
    budget = node_budgets([full.scores[1:]], sps).nodes[0]
    online = build_tree(drafter, hidden, 3, num_nodes=30, sps=sps)
    assert 0 < budget < 30
    assert online == full.truncate(budget)
