"""Numpy reference of TreeAccept (greedy) and TreeAcceptSampling: the source of truth.

Both walk the draft tree from the root, accepting at most one child per level, and stop at the
first level where no child is accepted or at depth `max_depth`. See README.md beside this file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tree_attention_mask.reference import validate_parents


@dataclass(frozen=True)
class TreeAcceptResult:
    """Outputs of TreeAccept / TreeAcceptSampling; D = max_depth.

    accepted_path: [batch, D + 1] int64, accepted node indices from the root (node 0), padded with -1
    accept_length: [batch] int64, accepted draft nodes + 1 (the bonus token counts, as in DeepSpec)
    bonus_token:   [batch] int64, the token emitted after the last accepted node
    kv_keep:       [batch, D + 1] int64, past_lengths[b] + accepted_path (cache slots to keep), -1 padded
    """

    accepted_path: np.ndarray
    accept_length: np.ndarray
    bonus_token: np.ndarray
    kv_keep: np.ndarray


def _check_common(parents: np.ndarray, draft_tokens: np.ndarray, past_lengths: np.ndarray, max_depth: int) -> None:
    validate_parents(parents)
    if draft_tokens.shape != parents.shape:
        raise ValueError(f"draft_tokens must have the shape of parents {parents.shape}, got {draft_tokens.shape}")
    if past_lengths.shape != (parents.shape[0],):
        raise ValueError(f"past_lengths must have shape ({parents.shape[0]},), got {past_lengths.shape}")
    if isinstance(max_depth, bool) or not isinstance(max_depth, int | np.integer) or max_depth < 0:
        raise ValueError(f"max_depth must be an integer >= 0, got {max_depth!r}")


def _children(parents_row: np.ndarray, node: int) -> list[int]:
    return [int(c) for c in np.flatnonzero(parents_row == node)]


def _result(paths: list[list[int]], bonus: list[int], past_lengths: np.ndarray, max_depth: int) -> TreeAcceptResult:
    batch = len(paths)
    accepted_path = np.full((batch, max_depth + 1), -1, dtype=np.int64)
    kv_keep = np.full((batch, max_depth + 1), -1, dtype=np.int64)
    for b, path in enumerate(paths):
        accepted_path[b, : len(path)] = path
        kv_keep[b, : len(path)] = np.asarray(path, dtype=np.int64) + int(past_lengths[b])
    return TreeAcceptResult(
        accepted_path=accepted_path,
        accept_length=np.array([len(p) for p in paths], dtype=np.int64),
        bonus_token=np.asarray(bonus, dtype=np.int64),
        kv_keep=kv_keep,
    )


def tree_accept_greedy(
    parents: np.ndarray,
    draft_tokens: np.ndarray,
    past_lengths: np.ndarray,
    target_tokens: np.ndarray,
    max_depth: int,
) -> TreeAcceptResult:
    """Greedy verification: at node u accept the first child (node order) whose token is target_tokens[u].

    parents:       [batch, N] int, valid tree (node 0 root = the anchor, padding -2)
    draft_tokens:  [batch, N] int, token at each node (node 0 holds the anchor token; not checked)
    past_lengths:  [batch] int, KV-cache length before the tree
    target_tokens: [batch, N] int, target argmax at each node (predicts that node's children)
    """
    parents, draft_tokens, target_tokens = (np.asarray(a) for a in (parents, draft_tokens, target_tokens))
    past_lengths = np.asarray(past_lengths)
    _check_common(parents, draft_tokens, past_lengths, max_depth)
    if target_tokens.shape != parents.shape:
        raise ValueError(f"target_tokens must have the shape of parents {parents.shape}, got {target_tokens.shape}")
    paths, bonus = [], []
    for b in range(parents.shape[0]):
        path = [0]
        while len(path) <= max_depth:
            want = target_tokens[b, path[-1]]
            match = [c for c in _children(parents[b], path[-1]) if draft_tokens[b, c] == want]
            if not match:
                break
            path.append(match[0])
        paths.append(path)
        bonus.append(int(target_tokens[b, path[-1]]))
    return _result(paths, bonus, past_lengths, max_depth)


def sample_from(residual: np.ndarray, uniform: float) -> int:
    """Inverse-CDF draw from an unnormalised non-negative vector: the first t with cumsum[t] > u * total.

    If rounding leaves no such t (u close to 1), the last token with positive mass is returned.
    """
    cdf = np.cumsum(residual)
    t = int(np.searchsorted(cdf, uniform * cdf[-1], side="right"))
    if t < residual.shape[0]:
        return t
    return int(np.flatnonzero(residual > 0)[-1])


def tree_accept_sampling(
    parents: np.ndarray,
    draft_tokens: np.ndarray,
    past_lengths: np.ndarray,
    target_probs: np.ndarray,
    draft_probs: np.ndarray,
    uniforms: np.ndarray,
    max_depth: int,
) -> TreeAcceptResult:
    """Lossless multi-candidate speculative sampling over the tree (recursive rejection sampling).

    parents:      [batch, N] int, valid tree
    draft_tokens: [batch, N] int, token at each node, in [0, V)
    past_lengths: [batch] int
    target_probs: [batch, N, V] float, target distribution at each node (over that node's children)
    draft_probs:  [batch, N, V] float, row c = the distribution node c's token was drawn from, given
                  its parent and its earlier siblings (row 0 unused); see README for each draft process
    uniforms:     [batch, N] float in [0, 1): uniforms[b, c] tests node c, uniforms[b, 0] draws the bonus

    At node u the residual r starts as target_probs[u] (mass Z). Children c of u are tried in node
    order: accept c iff uniforms[c] * q_c(x) * Z < r(x), x = draft_tokens[c]; on rejection
    r <- max(r - Z * q_c, 0) (kept unchanged if that has no mass left). If no child is accepted, or
    the walk reached max_depth, the bonus is drawn from r with uniforms[b, 0].
    """
    parents, draft_tokens, uniforms = (np.asarray(a) for a in (parents, draft_tokens, uniforms))
    target_probs, draft_probs, past_lengths = (np.asarray(a) for a in (target_probs, draft_probs, past_lengths))
    _check_common(parents, draft_tokens, past_lengths, max_depth)
    batch, n = parents.shape
    if target_probs.ndim != 3 or target_probs.shape[:2] != (batch, n):
        raise ValueError(f"target_probs must have shape [batch, N, V] = ({batch}, {n}, V), got {target_probs.shape}")
    vocab = target_probs.shape[2]
    if draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs must have the shape of target_probs {target_probs.shape}, got {draft_probs.shape}"
        )
    if uniforms.shape != (batch, n):
        raise ValueError(f"uniforms must have shape ({batch}, {n}), got {uniforms.shape}")
    if ((uniforms < 0) | (uniforms >= 1)).any():
        raise ValueError("uniforms must lie in [0, 1)")
    real = parents != -2
    if ((draft_tokens < 0) | (draft_tokens >= vocab))[:, 1:][real[:, 1:]].any():
        raise ValueError(f"draft_tokens of real non-root nodes must lie in [0, {vocab})")
    if (target_probs < 0).any() or (draft_probs < 0).any():
        raise ValueError("target_probs and draft_probs must be non-negative")
    if (target_probs.sum(-1)[real] <= 0).any():
        raise ValueError("every real node's target_probs row must have positive mass")

    paths, bonus = [], []
    for b in range(batch):
        path = [0]
        residual = target_probs[b, 0].astype(np.float64)
        while len(path) <= max_depth:
            accepted = None
            for c in _children(parents[b], path[-1]):
                x, q = draft_tokens[b, c], draft_probs[b, c].astype(np.float64)
                mass = residual.sum()
                if uniforms[b, c] * q[x] * mass < residual[x]:
                    accepted = c
                    break
                rest = np.maximum(residual - mass * q, 0.0)
                if rest.sum() > 0:
                    residual = rest
            if accepted is None:
                break
            path.append(accepted)
            residual = target_probs[b, accepted].astype(np.float64)
        paths.append(path)
        bonus.append(sample_from(residual, float(uniforms[b, 0])))
    return _result(paths, bonus, past_lengths, max_depth)
