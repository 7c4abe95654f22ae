"""The tree verifier: one target forward over [root + draft nodes], acceptance, cache compaction.

The root is the anchor (the last committed token, not yet in the target's cache); node i sits
at cache slot past + i and position past + depth(i), and attends to the filled cache and its
own ancestors only (`dspark.plugins.tree_attention_mask` + `compose_full_mask`). Acceptance is
`dspark.plugins.tree_accept_greedy` at temperature 0 and `tree_accept_sampling` otherwise, with
one-hot draft rows for best-first trees (a deterministic function of the drafter's outputs) and
"without_replacement" rows for sampled trees (plugins/tree_accept/README.md): either makes the
multi-candidate rule lossless.
Afterwards the target cache keeps the accepted path's slots, in order, and the drafter is fed
the context features of the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark import plugins
from dspark.models import KVCache, TargetModel, TargetOutput
from dspark.plugins import child_draft_probs

from .sampling import probabilities
from .tree_builder import DraftTree


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted node indices, root (0) first
    tokens: list[int]  # accepted draft tokens then the bonus (acceptance length = len(tokens))
    bonus: int

    @property
    def accepted_drafts(self) -> int:
        """Accepted draft nodes a (the acceptance length, bonus included, is a + 1)."""
        return len(self.path) - 1


def tree_inputs(tree: DraftTree, past_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> input_ids [1, N+1], position_ids [1, N+1] (past + depth), mask [1, 1, N+1, past+N+1]."""
    parents = tree.parents_tensor()
    past = torch.tensor([past_length])
    tree_mask = plugins.tree_attention_mask(parents, past)
    full = plugins.compose_full_mask(tree_mask.mask, past, past_length)
    return tree.tokens_tensor(), tree_mask.position_ids, full


@torch.no_grad()
def run_tree(target: TargetModel, tree: DraftTree, cache: KVCache, past_length: int) -> TargetOutput:
    """The verification forward; `cache` holds exactly `past_length` positions."""
    input_ids, position_ids, mask = tree_inputs(tree, past_length)
    return target(input_ids, position_ids, attention_mask=mask, past_key_values=cache)


def accept_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,  # [N+1, V] target rows at [root, nodes]
    *,
    temperature: float,
    generator: torch.Generator | None = None,
    max_depth: int | None = None,
) -> TreeVerdict:
    """Greedy walk (temperature 0) or lossless multi-candidate rejection sampling."""
    parents, tokens = tree.parents_tensor(), tree.tokens_tensor()
    past = torch.zeros(1, dtype=torch.int64)  # slots are not needed here: compaction uses the path
    depth = tree.max_depth if max_depth is None else max_depth
    if temperature == 0.0:
        result = plugins.tree_accept_greedy(
            parents=parents, draft_tokens=tokens, past_lengths=past,
            target_tokens=target_logits.argmax(dim=-1)[None], max_depth=depth,
        )
    else:
        target_probs = probabilities(target_logits, temperature)[None].double()  # [1, N+1, V]
        if tree.child_probs is None:  # best-first: a deterministic function of the drafter's outputs
            draft_probs = child_draft_probs(
                parents=parents, draft_tokens=tokens, parent_probs=target_probs, process="deterministic"
            )
        else:  # sample_tree: children drawn one after another without replacement
            draft_probs = child_draft_probs(
                parents=parents, draft_tokens=tokens, parent_probs=tree.child_probs[None],
                process="without_replacement",
            )
        uniforms = torch.rand(1, tree.num_nodes + 1, generator=generator, dtype=torch.float64)
        result = plugins.tree_accept_sampling(
            parents=parents, draft_tokens=tokens, past_lengths=past, target_probs=target_probs,
            draft_probs=draft_probs, uniforms=uniforms, max_depth=depth,
        )
    length = int(result.accept_length[0])
    path = result.accepted_path[0, :length].tolist()
    bonus = int(result.bonus_token[0])
    return TreeVerdict(path=path, tokens=[tree.tokens[i] for i in path[1:]] + [bonus], bonus=bonus)


def compact_kv_cache(cache: KVCache, past_length: int, path: list[int]) -> KVCache:
    """Keep the first `past_length` slots, then the tree slots past_length + path[i], in order.

    cache: per layer [B, kvh, past + N + 1, hd] (after the tree forward) -> [B, kvh, past + len(path), hd]
    """
    keep = torch.cat((torch.arange(past_length), past_length + torch.tensor(path, dtype=torch.int64)))
    return [(k.index_select(2, keep.to(k.device)), v.index_select(2, keep.to(v.device))) for k, v in cache]


def path_features(context_features: torch.Tensor, path: list[int]) -> torch.Tensor:
    """[1, N+1, F] features of the tree forward -> [1, len(path), F] of the accepted path, in order."""
    return context_features[:, torch.tensor(path, dtype=torch.int64)]


@dataclass(frozen=True)
class PackedTrees:
    """Several requests' trees in one padded batch; R = requests, T = 1 + max draft nodes.

    Row r holds tree r's nodes first, then padding nodes (parent -2, token 0, depth 0) that see
    only themselves; its cache slots are past_lengths[r] + node index, as for one tree.
    """

    parents: torch.Tensor  # [R, T] int64
    input_ids: torch.Tensor  # [R, T] int64
    position_ids: torch.Tensor  # [R, T] int64, past_lengths[r] + depth
    tree_mask: torch.Tensor  # [R, 1, T, T] bool, ancestor-only


def pack_trees(trees: list[DraftTree], past_lengths: list[int]) -> PackedTrees:
    """The batched runtime's feed for one tree-verification step (compose the cache columns with
    `dspark.plugins.compose_full_mask(packed.tree_mask, past_lengths, capacity)`)."""
    if len(trees) != len(past_lengths):
        raise ValueError(f"{len(trees)} trees but {len(past_lengths)} past lengths")
    width = 1 + max(t.num_nodes for t in trees)
    parents = torch.full((len(trees), width), -2, dtype=torch.int64)
    ids = torch.zeros(len(trees), width, dtype=torch.int64)
    for r, tree in enumerate(trees):
        parents[r, : tree.num_nodes + 1] = tree.parents_tensor()[0]
        ids[r, : tree.num_nodes + 1] = tree.tokens_tensor()[0]
    mask = plugins.tree_attention_mask(parents, torch.tensor(past_lengths, dtype=torch.int64))
    return PackedTrees(parents, ids, mask.position_ids, mask.mask)


def gather_accepted_kv(
    present: KVCache,  # per layer [R, kvh, S, hd]: row r's tree node i at column offset + i
    offset: int,
    paths: list[list[int]],  # accepted node indices per row, root first
) -> KVCache:
    """Batched compaction: a copy of `present` whose row r holds its accepted path's entries at
    columns offset .. offset + len(paths[r]) - 1, in path order, so a writer that commits
    `counts[r] = len(paths[r])` contiguous entries from `offset` (the batched runtime's
    `SlotCache.write`) keeps exactly the accepted nodes. Columns after a row's path are left as
    they were."""
    rows = torch.tensor([r for r, path in enumerate(paths) for _ in path], dtype=torch.int64)
    dst = torch.tensor([offset + i for path in paths for i in range(len(path))], dtype=torch.int64)
    src = torch.tensor([offset + node for path in paths for node in path], dtype=torch.int64)
    out: KVCache = []
    for k, v in present:
        k, v = k.clone(), v.clone()
        k[rows, :, dst] = k[rows, :, src]
        v[rows, :, dst] = v[rows, :, src]
        out.append((k, v))
    return out
