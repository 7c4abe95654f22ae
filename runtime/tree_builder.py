"""The tree builder: drafter block -> a best-first draft tree under a node budget.

The block is [anchor, masks...]; backbone slot d gives the distribution of depth-d+1 tokens.
A tree node at depth d (the root, the anchor, has depth 0) gets its children from slot d:

- `markov` mode: the sequential head runs once per expanded node, with `prev_ids` = the node's
  own token and the head state of the node's root-to-node path, so siblings get different
  child distributions (each child is conditioned on its actual parent);
- `marginals` mode: every node at depth d uses the same per-position distribution, the logits
  of slot d along the drafter's greedy chain (what a tree over plain per-position marginals,
  DDTree-style, sees); it is the comparison point for `markov`.

Best-first search (a heap over prefixes) adds, one at a time, the prefix with the highest score
= product of the (optionally temperature-calibrated) draft probabilities along its path. Each
node's children are tried in descending probability, so the k-th child is only pushed once the
(k-1)-th is in the tree: the first N nodes popped are exactly the N best prefixes, in
non-increasing score order, parents before children. Any prefix of the node list is therefore
itself a valid tree, which is what the node-budget scheduler truncates.

The tree does not depend on any random draw, so for temperature sampling its children follow the
"deterministic" draft process of TreeAcceptSampling (one-hot draft rows).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from dspark.models import DSparkDrafter

from .prefix_scheduler import Throughput, ThroughputRule, admit_by_throughput
from .proposer import propose_block

TreeMode = Literal["markov", "marginals"]
TREE_MODES: tuple[str, ...] = ("markov", "marginals")


class TreeConfigError(ValueError):
    """A tree-building parameter that cannot be used as given."""


@dataclass
class DraftTree:
    """One request's draft tree; N = draft nodes, node 0 is the root (the anchor).

    Nodes are in best-first order: scores are non-increasing and parents come before children.
    A sampled tree (`sample_tree`) keeps the best-first tree's shape and scores, and records the
    distribution each node's children were drawn from in `child_probs`.
    """

    parents: list[int]  # [N+1] parent node index; root -1
    tokens: list[int]  # [N+1] token of each node; node 0 holds the anchor
    depths: list[int]  # [N+1] root 0
    scores: list[float]  # [N+1] path product of draft probabilities (root 1.0)
    child_probs: torch.Tensor | None = None  # [N+1, V] q_u of sampled trees; None: deterministic

    @property
    def num_nodes(self) -> int:
        """Draft nodes, root excluded."""
        return len(self.parents) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def truncate(self, num_nodes: int) -> DraftTree:
        """The first `num_nodes` draft nodes (a valid tree: parents precede children)."""
        keep = num_nodes + 1
        probs = None if self.child_probs is None else self.child_probs[:keep]
        return DraftTree(self.parents[:keep], self.tokens[:keep], self.depths[:keep], self.scores[:keep], probs)

    def parents_tensor(self) -> torch.Tensor:
        """[1, N+1] int64, the plugins' layout."""
        return torch.tensor([self.parents], dtype=torch.int64)

    def tokens_tensor(self) -> torch.Tensor:
        """[1, N+1] int64."""
        return torch.tensor([self.tokens], dtype=torch.int64)


@dataclass
class _Expansion:
    """A node's children: candidate tokens in descending probability with their probabilities."""

    order: list[int]  # candidate child tokens, most probable first
    probs: list[float]  # their draft probabilities (calibrated)
    state: torch.Tensor | None  # [1, r] head state the node's children continue with


class _Expander:
    """Child distributions of tree nodes for one request's block."""

    def __init__(
        self,
        drafter: DSparkDrafter,
        hidden: torch.Tensor,  # [γ, H] backbone output of one request
        anchor: int,
        mode: TreeMode,
        score_temperature: float,
        top_k: int,
    ) -> None:
        self.drafter, self.hidden, self.mode = drafter, hidden, mode
        self.score_temperature, self.top_k = score_temperature, top_k
        self.base = drafter.base_logits(hidden)  # [γ, V]
        self.initial_state = drafter.initial_head_state(hidden[:1])
        if mode == "marginals":  # the drafter's greedy chain
            self.chain_logits = propose_block(drafter, hidden[None], torch.tensor([anchor]), 0.0).logits[0]  # [γ, V]

    def _step(self, depth: int, prev: torch.Tensor, state: torch.Tensor | None):
        return self.drafter.head_step(
            hidden=self.hidden[depth : depth + 1], base_logits=self.base[depth : depth + 1], prev_ids=prev, state=state
        )

    def child_logits(self, depth: int, token: int, state: torch.Tensor | None):
        """-> logits [V] of the children of a node at `depth` holding `token`, whose path left the
        head in `state`, and the state those children continue with."""
        if self.mode == "markov":
            logits, _, next_state = self._step(depth, torch.tensor([token]), state)
            return logits[0], next_state
        return self.chain_logits[depth], None

    def expand(self, depth: int, token: int, state: torch.Tensor | None) -> _Expansion:
        logits, next_state = self.child_logits(depth, token, state)
        probs = torch.softmax(logits.double() / self.score_temperature, dim=-1)
        top = torch.topk(probs, min(self.top_k, probs.shape[0]))
        return _Expansion(top.indices.tolist(), top.values.tolist(), next_state)


@torch.no_grad()
def build_tree(
    drafter: DSparkDrafter,
    hidden: torch.Tensor,  # [γ, H] backbone output of one request's block
    anchor: int,
    *,
    num_nodes: int,
    mode: TreeMode = "markov",
    score_temperature: float = 1.0,
    top_k: int | None = None,
    sps: Callable[[int], float] | None = None,
) -> DraftTree:
    """Best-first draft tree of at most `num_nodes` draft nodes (fewer if the block's depth and
    `top_k` children per node cannot hold that many). `score_temperature` calibrates the draft
    probabilities used for scoring; `top_k` bounds the children per node (default: `num_nodes`).
    With `sps` (steps/s at B verified tokens) the node scheduler runs while the tree grows: nodes
    come out by non-increasing score, so stopping at the first node that does not raise τ·SPS(B)
    gives exactly `node_budgets([scores], sps)` of the full tree, without expanding the rest."""
    if mode not in TREE_MODES:
        raise TreeConfigError(f"tree mode must be one of {TREE_MODES}, got {mode!r}")
    if num_nodes < 0:
        raise TreeConfigError(f"num_nodes must be >= 0, got {num_nodes}")
    if not score_temperature > 0.0:
        raise TreeConfigError(f"score_temperature must be > 0, got {score_temperature}")
    if hidden.dim() != 2:
        raise TreeConfigError(f"hidden must be one request's block [γ, H], got shape {tuple(hidden.shape)}")
    gamma = hidden.shape[0]
    k = max(num_nodes, 1) if top_k is None else top_k
    if k < 1:
        raise TreeConfigError(f"top_k must be >= 1, got {top_k}")
    expander = _Expander(drafter, hidden, anchor, mode, score_temperature, k)
    tree = DraftTree(parents=[-1], tokens=[anchor], depths=[0], scores=[1.0])
    expansions = [expander.expand(0, anchor, expander.initial_state)]
    # Heap of (-score, tie-break counter, parent node, child rank); the key is the stored score
    # itself, so the nodes come out exactly non-increasing (what node_budgets checks).
    heap: list[tuple[float, int, int, int]] = []
    counter = 0

    def push(parent: int, rank: int) -> None:
        nonlocal counter
        expansion = expansions[parent]
        if rank < len(expansion.order) and expansion.probs[rank] > 0.0:
            score = tree.scores[parent] * expansion.probs[rank]
            heapq.heappush(heap, (-score, counter, parent, rank))
            counter += 1

    rule = None if sps is None else ThroughputRule(1, _throughput(sps))
    push(0, 0)
    while heap and tree.num_nodes < num_nodes:
        key, _, parent, rank = heapq.heappop(heap)
        if rule is not None and not rule.admit(-key):
            break
        expansion = expansions[parent]
        node = len(tree.parents)
        tree.parents.append(parent)
        tree.tokens.append(expansion.order[rank])
        tree.depths.append(tree.depths[parent] + 1)
        tree.scores.append(tree.scores[parent] * expansion.probs[rank])
        push(parent, rank + 1)  # the next sibling becomes a candidate
        if tree.depths[node] < gamma and tree.num_nodes < num_nodes:
            expansions.append(expander.expand(tree.depths[node], tree.tokens[node], expansion.state))
            push(node, 0)
        else:  # a leaf: slot γ-1 was the block's last, or the budget is full
            expansions.append(_Expansion([], [], None))
    return tree


@torch.no_grad()
def sample_tree(
    drafter: DSparkDrafter,
    hidden: torch.Tensor,  # [γ, H] backbone output of one request's block
    shape: DraftTree,  # the topology, e.g. build_tree's (must not depend on this call's draws)
    *,
    temperature: float,
    generator: torch.Generator | None = None,
    mode: TreeMode = "markov",
) -> DraftTree:
    """Re-draw the tokens of a tree topology by sampling: node u's k children are k draws without
    replacement from q_u = softmax(logits_u / temperature), in node order, where (markov mode)
    q_u is conditioned on u's sampled token and path. TreeAcceptSampling's "without_replacement"
    process then verifies it losslessly; unlike a deterministic tree it keeps chain drafting's
    acceptance when q is close to the target at temperature > 0."""
    if mode not in TREE_MODES:
        raise TreeConfigError(f"tree mode must be one of {TREE_MODES}, got {mode!r}")
    if not temperature > 0.0:
        raise TreeConfigError(f"sampled trees need temperature > 0, got {temperature}")
    anchor = shape.tokens[0]
    expander = _Expander(drafter, hidden, anchor, mode, score_temperature=1.0, top_k=1)
    children: list[list[int]] = [[] for _ in shape.parents]
    for c in range(1, shape.num_nodes + 1):
        children[shape.parents[c]].append(c)
    tokens, states = [anchor] + [0] * shape.num_nodes, [expander.initial_state] * (shape.num_nodes + 1)
    probs = torch.zeros(shape.num_nodes + 1, drafter.config.vocab_size, dtype=torch.float64)
    for u in range(shape.num_nodes + 1):
        if not children[u]:
            continue
        logits, state = expander.child_logits(shape.depths[u], tokens[u], states[u])
        probs[u] = torch.softmax(logits.double() / temperature, dim=-1)
        if int((probs[u] > 0).sum()) < len(children[u]):
            raise TreeConfigError(
                f"node {u} has {len(children[u])} children but only {int((probs[u] > 0).sum())} tokens with "
                f"positive probability at temperature {temperature}: sample a smaller tree or raise the temperature"
            )
        draws = torch.multinomial(probs[u], len(children[u]), replacement=False, generator=generator)
        for c, token in zip(children[u], draws.tolist(), strict=True):
            tokens[c], states[c] = token, state
    return DraftTree(list(shape.parents), tokens, list(shape.depths), list(shape.scores), probs)


@dataclass(frozen=True)
class NodeBudget:
    """The node scheduler's decision for one step."""

    nodes: tuple[int, ...]  # draft nodes admitted per request (a prefix of its best-first nodes)
    expected_accepts: float  # τ: Σ over requests of 1 + Σ admitted survivals
    expected_throughput: float  # Θ = τ·SPS(B), B = Σ (1 + nodes)
    considered: int  # candidates evaluated before stopping


def node_budgets(
    survivals: list[list[float]],  # per request: survival of each draft node, best-first order
    sps: Callable[[int], float],  # steps per second when verifying B tokens in one step
    max_nodes: int | None = None,  # cap per request
) -> NodeBudget:
    """The prefix scheduler (DSpark Algorithm 1, `prefix_scheduler.admit_by_throughput`) over
    tree nodes instead of chain slots.

    A node's survival is the probability that the target accepts it (e.g. its path product of
    calibrated draft probabilities); the expected accepted length of a tree is 1 + the sum of its
    nodes' survivals. Candidates (r, node) are taken by descending survival (ties: request, then
    node order), starting from B = R verified roots and τ = R, and admitted while
    Θ = τ·SPS(B) rises; the first candidate that does not raise Θ stops the scan. Admission
    depends only on draft-side survivals, never on the target, and since a node's survival never
    exceeds its parent's, each request's admitted nodes form a prefix of its best-first order
    (a valid tree). Pure: no model, no clock.
    """
    if max_nodes is not None and max_nodes < 0:
        raise TreeConfigError(f"max_nodes must be >= 0, got {max_nodes}")
    for r, row in enumerate(survivals):
        bad = [i for i, (a, b) in enumerate(itertools.pairwise(row)) if b > a]
        if bad:
            raise TreeConfigError(
                f"survivals of request {r} must be non-increasing (best-first order); node {bad[0] + 1} "
                f"has {row[bad[0] + 1]} after {row[bad[0]]}"
            )
    rows = survivals if max_nodes is None else [row[:max_nodes] for row in survivals]
    decision = admit_by_throughput(rows, _throughput(sps))
    return NodeBudget(decision.lengths, decision.expected_accepts, decision.expected_throughput, decision.considered)


def _throughput(sps: Callable[[int], float]) -> Throughput:
    """Θ(τ, B) = τ·SPS(B) from steps per second at B verified tokens."""
    return lambda tau, tokens: tau * np.array([sps(int(b)) for b in tokens], dtype=np.float64)
