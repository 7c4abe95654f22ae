"""Draft trees for every request of a batch at once: tree expansion batched per depth, Algorithm 1
over all requests' nodes.

The drafter backbone gives each request's block [γ, H] (slot d: the distribution of depth-d+1
tokens). A node at depth d holding token x gets its children from one call of the sequential head
on slot d with `prev_ids` = x and the head state its path left (markov drafting, as
`tree_builder.build_tree`). Here every node that needs expanding, across all requests, goes into
ONE head call per round, and a round adds one depth: at most γ head calls per step, whatever the
number of requests or nodes.

Which nodes? Every expanded node offers its `top_k` most probable children as candidates, scored
by the path product of their (calibrated) draft probabilities. Each round the node scheduler
ranks all known candidates and admits them with Algorithm 1 (`prefix_scheduler.admit_by_throughput`:
descending score across requests, while Θ = τ·SPS(B) rises, B = verified tokens packed), capped at
`max_nodes` per request; or, with no cost model, each request's `max_nodes` best. Admitted nodes
not yet expanded are the next round's head call. A child never scores above its parent, so when no
admitted node is left to expand, no unknown node could have been admitted: the result is exactly
the best-first tree (per request, with the node cap alone: `build_tree`'s tree, tested).

The trees depend on the drafter's outputs only, never on a random draw, so TreeAccept's
"deterministic" draft process verifies them losslessly under sampling too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .prefix_scheduler import Throughput, admit_by_throughput
from .tree_builder import DraftTree, TreeConfigError

# feeds -> outputs of the `drafter_head_step` graph (hidden, prev_ids[, base_logits][, state])
HeadCall = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass(frozen=True)
class TreeOptions:
    max_nodes: int = 16  # draft nodes per request at most (root excluded)
    top_k: int = 4  # children offered per expanded node
    score_temperature: float = 1.0  # calibrates the draft probabilities that score nodes

    def __post_init__(self) -> None:
        if self.max_nodes < 0:
            raise TreeConfigError(f"tree max_nodes must be >= 0, got {self.max_nodes}")
        if self.top_k < 1:
            raise TreeConfigError(f"tree top_k must be >= 1, got {self.top_k}")
        if not self.score_temperature > 0.0:
            raise TreeConfigError(f"tree score_temperature must be > 0, got {self.score_temperature}")


@dataclass
class _Entry:
    """A known node of one request's tree: admitted or still a candidate."""

    parent: int  # entry index of the parent (-1: the root)
    token: int
    depth: int
    score: float  # path product of draft probabilities
    state: np.ndarray | None  # head state this node's children are computed with (its parent's next state)
    expanded: bool = False


@dataclass
class GrownTrees:
    trees: list[DraftTree]  # one per request, best-first node order
    expected_accepts: float | None  # τ of Algorithm 1's admission (None without a cost model)
    head_calls: int  # rounds of batched expansion
    expanded: list[int] = field(default_factory=list)  # nodes expanded per round


def grow_trees(
    head: HeadCall | None,  # None: a drafter without heads (children from the base logits)
    hidden: np.ndarray,  # [R, γ, H] backbone block outputs
    base_logits: np.ndarray | None,  # [R, γ, V]
    anchors: np.ndarray,  # [R]
    options: TreeOptions,
    *,
    feed_base_logits: bool,
    state_size: int,
    throughput: Throughput | None = None,  # Θ(τ, B); None: `max_nodes` best per request
) -> GrownTrees:
    rows, gamma = hidden.shape[:2]
    entries = [[_Entry(-1, int(anchors[r]), 0, 1.0, np.zeros(state_size, hidden.dtype) if state_size else None)]
               for r in range(rows)]
    admitted: list[list[int]] = [[0] for _ in range(rows)]  # entry indices in best-first order
    expected, calls, per_round = None, 0, []
    while True:
        todo = [(r, i) for r in range(rows) for i in admitted[r]
                if not entries[r][i].expanded and entries[r][i].depth < gamma and options.max_nodes > 0]
        if not todo:
            break
        _expand(head, hidden, base_logits, entries, todo, options, feed_base_logits)
        calls += 1
        per_round.append(len(todo))
        admitted, expected = _admit(entries, options.max_nodes, throughput)
    return GrownTrees([_tree(entries[r], admitted[r]) for r in range(rows)], expected, calls, per_round)


def _expand(head: HeadCall | None, hidden: np.ndarray, base_logits: np.ndarray | None,
            entries: list[list[_Entry]], todo: list[tuple[int, int]], options: TreeOptions,
            feed_base_logits: bool) -> None:
    """One head call over the nodes `todo` (request, entry) of any requests and depths; each
    offers its top_k children as candidate entries."""
    rows = np.array([r for r, _ in todo], dtype=np.int64)
    nodes = [entries[r][i] for r, i in todo]
    depths = np.array([n.depth for n in nodes], dtype=np.int64)
    next_states: list[np.ndarray | None] = [None] * len(todo)
    if head is None:
        logits = base_logits[rows, depths]
    else:
        feeds = {"hidden": np.ascontiguousarray(hidden[rows, depths]),
                 "prev_ids": np.array([n.token for n in nodes], dtype=np.int64)}
        if feed_base_logits:
            feeds["base_logits"] = np.ascontiguousarray(base_logits[rows, depths])
        if nodes[0].state is not None:
            feeds["state"] = np.stack([n.state for n in nodes])
        out = head(feeds)
        logits = np.asarray(out["logits"])
        if "next_state" in out:
            next_states = list(np.asarray(out["next_state"]))
    # scores in float64 through torch, as build_tree computes them (same order, same ties)
    probs = torch.softmax(torch.from_numpy(np.asarray(logits)).double() / options.score_temperature, dim=-1)
    top = torch.topk(probs, min(options.top_k, probs.shape[-1]), dim=-1)
    for (r, i), node, state, tokens, values in zip(todo, nodes, next_states, top.indices.tolist(),
                                                   top.values.tolist(), strict=True):
        node.expanded = True
        for token, p in zip(tokens, values, strict=True):
            if p > 0.0:
                entries[r].append(_Entry(i, token, node.depth + 1, node.score * p, state))


def _admit(entries: list[list[_Entry]], max_nodes: int,
           throughput: Throughput | None) -> tuple[list[list[int]], float | None]:
    """Every request's admitted entries (root first, then best-first), from all known candidates."""
    ranked = [sorted(range(1, len(row)), key=lambda i, row=row: (-row[i].score, i))[:max_nodes] for row in entries]
    if throughput is None:
        return [[0, *order] for order in ranked], None
    decision = admit_by_throughput([[entries[r][i].score for i in order] for r, order in enumerate(ranked)],
                                   throughput)
    return [[0, *order[:n]] for order, n in zip(ranked, decision.lengths, strict=True)], decision.expected_accepts


def _tree(row: list[_Entry], admitted: list[int]) -> DraftTree:
    """Admitted entries -> a DraftTree in best-first order (a parent scores at least its children
    and was created first, so it always precedes them)."""
    index = {entry: node for node, entry in enumerate(admitted)}
    return DraftTree(parents=[-1] + [index[row[e].parent] for e in admitted[1:]],
                     tokens=[row[e].token for e in admitted], depths=[row[e].depth for e in admitted],
                     scores=[row[e].score for e in admitted])
