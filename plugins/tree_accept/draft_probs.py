"""Per-child draft distributions for TreeAcceptSampling, one builder per draft process.

TreeAcceptSampling reads row c of `draft_probs` as the distribution node c's token was drawn from,
given its parent and its earlier siblings. These helpers build that tensor from the distribution
the drafter proposed at each parent (`parent_probs[u]` = q_u, the children distribution of u).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

DraftProcess = Literal["iid", "without_replacement", "deterministic"]
DRAFT_PROCESSES: tuple[str, ...] = ("iid", "without_replacement", "deterministic")


def child_draft_probs(
    parents: np.ndarray, draft_tokens: np.ndarray, parent_probs: np.ndarray, process: DraftProcess
) -> np.ndarray:
    """Rows for TreeAcceptSampling's draft_probs input.

    parents:      [batch, N] int, valid tree
    draft_tokens: [batch, N] int
    parent_probs: [batch, N, V] float, q_u at each node u (unused for "deterministic")
    process (the draft process that built the tree) -> row c for a child c of u:
      "iid"                  children of u drawn independently from q_u -> q_u
      "without_replacement"  children of u drawn one after another from q_u without repeating a
                             token -> q_u with the earlier siblings' tokens zeroed, renormalised
      "deterministic"        children chosen without randomness (top-k, best-first search); the
                             tree must not depend on the uniforms -> one-hot(draft_tokens[c])
    returns [batch, N, V] float64; rows of the root and of padding nodes are zero.
    """
    if process not in DRAFT_PROCESSES:
        raise ValueError(f"process must be one of {DRAFT_PROCESSES}, got {process!r}")
    batch, n = parents.shape
    rows = np.arange(batch)
    out = np.zeros((batch, n, parent_probs.shape[-1]), dtype=np.float64)
    for c in range(1, n):
        u = parents[:, c]
        real = rows[u >= 0]
        if process == "deterministic":
            out[real, c, draft_tokens[real, c]] = 1.0
            continue
        q = parent_probs[real, u[real]].astype(np.float64)
        if process == "without_replacement":
            for s in range(1, c):  # earlier siblings' tokens cannot be drawn again
                sibling = real[parents[real, s] == u[real]]
                q[np.searchsorted(real, sibling), draft_tokens[sibling, s]] = 0.0
            mass = q.sum(axis=-1, keepdims=True)
            if (mass <= 0).any():
                b = int(real[np.flatnonzero(mass[:, 0] <= 0)[0]])
                raise ValueError(
                    f"node {c} (batch {b}): its earlier siblings exhaust the support of q at node "
                    f"{int(u[b])}; sampling without replacement cannot draw it"
                )
            q = q / mass
        out[real, c] = q
    return out
