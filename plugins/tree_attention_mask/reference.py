"""Numpy reference of TreeAttentionMask: the source of truth for every other implementation.

A draft tree of N nodes per request is given by `parents` [batch, N]:
node 0 is the root (parent -1), every real node's parent is an earlier real node, and padding
nodes have parent -2. See README.md beside this file for the full contract.
"""

from __future__ import annotations

import numpy as np

ROOT_PARENT = -1
PAD_PARENT = -2
WORD_BITS = 32


def validate_parents(parents: np.ndarray) -> None:
    """Raise ValueError naming the first offending entry if `parents` [batch, N] is not a valid tree."""
    if not isinstance(parents, np.ndarray) or not np.issubdtype(parents.dtype, np.integer):
        raise TypeError(f"parents must be an integer numpy array, got {type(parents).__name__}")
    if parents.ndim != 2 or parents.shape[1] < 1:
        raise ValueError(f"parents must have shape [batch, num_nodes >= 1], got {parents.shape}")
    bad_root = np.flatnonzero(parents[:, 0] != ROOT_PARENT)
    if bad_root.size:
        b = int(bad_root[0])
        raise ValueError(f"parents[{b}, 0] = {int(parents[b, 0])}: node 0 must be the root (parent -1)")
    node = np.arange(parents.shape[1])
    real = parents != PAD_PARENT
    in_order = (parents >= 0) & (parents < node)
    bad = np.argwhere(~(in_order | ~real)[:, 1:])
    if bad.size:
        b, i = int(bad[0, 0]), int(bad[0, 1]) + 1
        raise ValueError(
            f"parents[{b}, {i}] = {int(parents[b, i])}: a node's parent must be an earlier node "
            f"(0 <= parent < {i}), or -2 to mark padding"
        )
    parent_real = np.take_along_axis(real, np.clip(parents, 0, None), axis=1)
    bad = np.argwhere(real & (parents >= 0) & ~parent_real)
    if bad.size:
        b, i = int(bad[0, 0]), int(bad[0, 1])
        raise ValueError(f"parents[{b}, {i}] = {int(parents[b, i])} is a padding node; only real nodes have children")


def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    """anc[b, i, j] is True iff node j is node i or one of its ancestors; padding rows hold only i.

    parents: [batch, N] valid tree (see validate_parents) -> bool [batch, N, N]
    """
    batch, n = parents.shape
    anc = np.zeros((batch, n, n), dtype=bool)
    rows = np.arange(batch)
    for i in range(n):  # topological order: a parent's row is final before its children read it
        parent = parents[:, i]
        has_parent = parent >= 0
        anc[has_parent, i] = anc[rows[has_parent], parent[has_parent]]
        anc[:, i, i] = True
    return anc


def depths(parents: np.ndarray) -> np.ndarray:
    """depth[b, i] = number of strict ancestors of node i (root 0, padding 0). [batch, N] -> int64"""
    return ancestor_matrix(parents).sum(axis=-1).astype(np.int64) - 1


def pack_bits(mask: np.ndarray) -> np.ndarray:
    """Pack the last axis of a bool array into int32 words: bit j % 32 of word j // 32 holds mask[..., j].

    mask: [..., N] bool -> [..., ceil(N / 32)] int32 (bit 31 is the sign bit)
    """
    n = mask.shape[-1]
    words = -(-n // WORD_BITS)
    padded = np.zeros((*mask.shape[:-1], words * WORD_BITS), dtype=np.uint64)
    padded[..., :n] = mask
    weights = np.uint64(1) << np.arange(WORD_BITS, dtype=np.uint64)
    packed = (padded.reshape(*mask.shape[:-1], words, WORD_BITS) * weights).sum(axis=-1)
    return packed.astype(np.uint32).view(np.int32)


def unpack_bits(packed: np.ndarray, num_nodes: int) -> np.ndarray:
    """Inverse of pack_bits: [..., W] int32 -> [..., num_nodes] bool."""
    bits = (packed.view(np.uint32)[..., None] >> np.arange(WORD_BITS, dtype=np.uint32)) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :num_nodes].astype(bool)


def tree_attention_mask(parents: np.ndarray, past_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The TreeAttentionMask operator.

    parents:      [batch, N] int, node 0 the root (-1), padding -2
    past_lengths: [batch] int, tokens already in each request's KV cache
    returns
      mask:         [batch, 1, N, N] bool, mask[b, 0, i, j] = j is i or an ancestor of i
      position_ids: [batch, N] int64, past_lengths[b] + depth(i)
      packed_mask:  [batch, N, ceil(N / 32)] int32, pack_bits(mask[:, 0])
    """
    validate_parents(parents)
    past_lengths = np.asarray(past_lengths)
    if past_lengths.shape != (parents.shape[0],):
        raise ValueError(f"past_lengths must have shape [batch] = ({parents.shape[0]},), got {past_lengths.shape}")
    if (past_lengths < 0).any():
        raise ValueError(f"past_lengths must be >= 0, got {past_lengths.tolist()}")
    anc = ancestor_matrix(parents)
    position_ids = past_lengths.astype(np.int64)[:, None] + anc.sum(axis=-1) - 1
    return anc[:, None], position_ids, pack_bits(anc)


def compose_full_mask(tree_mask: np.ndarray, past_lengths: np.ndarray, past_capacity: int) -> np.ndarray:
    """Prepend the KV-cache columns: [batch, 1, N, N] tree mask -> [batch, 1, N, past_capacity + N].

    Column k < past_capacity is True iff k < past_lengths[b] (a filled cache slot); the last N columns
    are the tree mask, i.e. the tree's keys sit right after the cache's capacity (a padded cache).
    """
    batch, _, n, _ = tree_mask.shape
    past_valid = np.arange(past_capacity)[None, :] < np.asarray(past_lengths)[:, None]  # [batch, P]
    past = np.broadcast_to(past_valid[:, None, None, :], (batch, 1, n, past_capacity))
    return np.concatenate([past, tree_mask], axis=-1)
