"""Sample feeds for every graph: tracing examples, parity cases and benchmarks.

Masks follow the contract (True = may attend). A tree is given by `parents` (parent index of each
node, -1 for the root, parents before children); its flattened mask lets every node see the
cached past and its own root-to-node path, and its positions are past + depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.models import DrafterConfig, TargetConfig, causal_mask

from .contract import kv_dims

MASK_KINDS = ("causal", "tree", "padded")


@dataclass(frozen=True)
class Case:
    """One parity case: B rows of T new tokens on top of P cached positions."""

    batch: int
    tokens: int
    past: int
    mask: str = "causal"  # one of MASK_KINDS

    @property
    def label(self) -> str:
        return f"{self.mask} b{self.batch} t{self.tokens} p{self.past}"


def random_parents(tokens: int, generator: torch.Generator) -> list[int]:
    """A random tree over `tokens` nodes: node 0 is the root, node i hangs under a node < i."""
    return [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, tokens)]


def tree_mask(parents: list[int], past: int) -> torch.Tensor:
    """[1, 1, T, P+T] bool: node t sees all past positions and its ancestors (and itself)."""
    tokens = len(parents)
    mask = torch.zeros(tokens, past + tokens, dtype=torch.bool)
    mask[:, :past] = True
    for t in range(tokens):
        node = t
        while node >= 0:
            mask[t, past + node] = True
            node = parents[node]
    return mask[None, None]


def tree_positions(parents: list[int], past: int) -> torch.Tensor:
    """[1, T] int64: past + depth of each node."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return (torch.tensor(depth) + past)[None]


def mask_and_positions(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """-> attention_mask [B, 1, T, P+T] bool, position_ids [B, T] int64 for `case`."""
    b, t, p = case.batch, case.tokens, case.past
    if case.mask == "causal":
        return causal_mask(b, t, p).contiguous(), torch.arange(p, p + t).expand(b, t).contiguous()
    if case.mask == "tree":
        masks, positions = [], []
        for _ in range(b):
            parents = random_parents(t, generator)
            masks.append(tree_mask(parents, p))
            positions.append(tree_positions(parents, p))
        return torch.cat(masks), torch.cat(positions)
    if case.mask == "padded":
        # Row r is left-padded by r*3 cached positions (capped at P): those columns are hidden.
        mask = causal_mask(b, t, p).clone()
        positions = []
        for r in range(b):
            pad = min(3 * r, p)
            mask[r, :, :, :pad] = False
            positions.append(torch.arange(p - pad, p - pad + t))
        return mask, torch.stack(positions)
    raise ValueError(f"unknown mask kind {case.mask!r} (expected one of {MASK_KINDS})")


def target_feeds(
    config: TargetConfig, case: Case, dtype: torch.dtype, generator: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """(input_ids, position_ids, attention_mask, *past k/v) for the concat-cache target graph."""
    ids = torch.randint(0, config.vocab_size, (case.batch, case.tokens), generator=generator)
    mask, positions = mask_and_positions(case, generator)
    past = [torch.randn(case.batch, kvh, case.past, hd, generator=generator).to(dtype)
            for kvh, hd in kv_dims(config) for _ in ("key", "value")]
    return (ids, positions, mask, *past)


def static_feeds(
    concat_feeds: tuple[torch.Tensor, ...], spare_slots: int, generator: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """The static-cache graph's feeds equivalent to `concat_feeds`: every cache gets
    `spare_slots` extra slots of garbage, hidden by the mask."""
    ids, positions, mask, *past = concat_feeds
    b, _, t, _ = mask.shape
    hidden = torch.zeros(b, 1, t, spare_slots, dtype=torch.bool)
    p = past[0].shape[2]
    mask = torch.cat((mask[..., :p], hidden, mask[..., p:]), dim=-1)
    caches = []
    for kv in past:
        garbage = torch.randn(*kv.shape[:2], spare_slots, kv.shape[3], generator=generator).to(kv.dtype)
        caches.append(torch.cat((kv, garbage), dim=2))
    return (ids, positions, mask, *caches)


def backbone_feeds(
    config: DrafterConfig, case: Case, dtype: torch.dtype, generator: torch.Generator
) -> tuple[torch.Tensor, ...]:
    """Backbone feeds: `case.tokens` new context rows on `case.past` cached ones, then the block.
    A "padded" case hides a per-row prefix of the cached context; other kinds see everything."""
    b, tc, pc, block = case.batch, case.tokens, case.past, config.block_size
    anchor = torch.randint(0, config.vocab_size, (b, 1), generator=generator)
    block_ids = torch.cat((anchor, torch.full((b, block - 1), config.mask_token_id)), dim=1)
    start = pc + tc
    block_positions = torch.arange(start, start + block).expand(b, block).contiguous()
    features = torch.randn(b, tc, config.context_feature_size, generator=generator).to(dtype)
    context_positions = torch.arange(pc, start).expand(b, tc).contiguous()
    mask = torch.ones(b, 1, block, start + block, dtype=torch.bool)
    if case.mask == "padded":
        for r in range(b):
            mask[r, :, :, : min(3 * r, pc)] = False
    past = [torch.randn(b, kvh, pc, hd, generator=generator).to(dtype)
            for kvh, hd in kv_dims(config) for _ in ("key", "value")]
    return (block_ids, block_positions, features, context_positions, mask, *past)


def head_step_feeds(
    config: DrafterConfig,
    batch: int,
    lm_head_in_backbone: bool,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    """(hidden, [base_logits], prev_ids, [state]) in the order of `contract.head_step_spec`."""
    feeds = [torch.randn(batch, config.hidden_size, generator=generator).to(dtype)]
    if lm_head_in_backbone:
        feeds.append((4 * torch.randn(batch, config.vocab_size, generator=generator)).to(dtype))
    feeds.append(torch.randint(0, config.vocab_size, (batch,), generator=generator))
    if config.has_markov_head and config.markov_head_type == "rnn":
        feeds.append(torch.randn(batch, config.markov_rank, generator=generator).tanh().to(dtype))
    return tuple(feeds)


def head_greedy_feeds(
    config: DrafterConfig,
    batch: int,
    lm_head_in_backbone: bool,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> tuple[torch.Tensor, ...]:
    """(block_hidden, [base_logits], anchor_ids) in the order of `contract.head_greedy_spec`."""
    shape = (batch, config.block_size)
    feeds = [torch.randn(*shape, config.hidden_size, generator=generator).to(dtype)]
    if lm_head_in_backbone:
        feeds.append((4 * torch.randn(*shape, config.vocab_size, generator=generator)).to(dtype))
    feeds.append(torch.randint(0, config.vocab_size, (batch,), generator=generator))
    return tuple(feeds)
