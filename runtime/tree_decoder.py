"""Tree decoding of one request with the PyTorch models: reference_decoder's loop, with trees.

Same semantics as `speculative_generate` (anchor as the block's first slot, drafter context
cache fed the kept tokens' features, target cache rolled back to the accepted tokens), except
that each round verifies a best-first draft tree (tree_builder) in one target forward and keeps
the accepted root-to-leaf path (tree_verifier). Greedy decoding equals target greedy; sampling
follows the target distribution exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from dspark.models import DSparkDrafter, TargetModel

from .requests import RequestError, find_stop, truncate_at_stop, validate_request
from .sampling import round_generator, round_seed, sample_token
from .tree_builder import DraftTree, TreeMode, build_tree, sample_tree
from .tree_verifier import accept_tree, compact_kv_cache, path_features, run_tree

TreeDraw = Literal["best_first", "sampled"]
TREE_DRAWS: tuple[str, ...] = ("best_first", "sampled")


@dataclass
class TreeRoundStats:
    start: int  # position of the anchor
    anchor: int
    tree_nodes: int  # draft nodes verified (root excluded)
    tree_depth: int
    expected_acceptance: float  # 1 + Σ node scores: the builder's own estimate
    accepted_drafts: int  # a
    acceptance_length: int  # a + 1: the bonus token counts


@dataclass
class TreeResult:
    tokens: list[int]  # generated tokens, prompt excluded
    rounds: list[TreeRoundStats] = field(default_factory=list)
    stopped_by_token: bool = False

    @property
    def mean_acceptance_length(self) -> float:
        return sum(r.acceptance_length for r in self.rounds) / max(len(self.rounds), 1)


@torch.no_grad()
def tree_generate(
    target: TargetModel,
    drafter: DSparkDrafter,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    num_nodes: int,
    mode: TreeMode = "markov",
    draw: TreeDraw = "best_first",
    temperature: float = 0.0,
    seed: int = 0,
    score_temperature: float = 1.0,
    top_k: int | None = None,
    sps: Callable[[int], float] | None = None,
    stop_token_ids: Sequence[int] = (),
    observer: Callable[[TreeRoundStats, DraftTree], None] | None = None,
) -> TreeResult:
    """Tree speculative decoding of one request.

    `num_nodes` draft nodes per round (root excluded); with `sps` (steps per second when
    verifying B tokens) the node scheduler (`node_budgets`'s rule, applied while the tree grows)
    picks each round's budget, at most `num_nodes`, by the node scores. `draw="sampled"` (temperature > 0) keeps the
    best-first tree's shape and samples its tokens (`sample_tree`). `observer`, if given, sees every round's stats and
    verified tree.
    """
    cfg = target.config
    prompt_ids = validate_request(prompt_ids, vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                                  max_new_tokens=max_new_tokens, temperature=temperature)
    if num_nodes < 0:
        raise RequestError(f"num_nodes must be >= 0, got {num_nodes}")
    if draw not in TREE_DRAWS:
        raise RequestError(f"draw must be one of {TREE_DRAWS}, got {draw!r}")
    if draw == "sampled" and temperature == 0.0:
        raise RequestError("draw='sampled' needs temperature > 0 (greedy decoding uses best-first trees)")
    gamma = drafter.config.block_size
    generator = round_generator(seed)
    n = len(prompt_ids)
    prefill = target(torch.tensor([prompt_ids]), torch.arange(n)[None])
    anchor = int(sample_token(prefill.logits[:, -1], temperature, generator))
    target_cache, new_context = prefill.present, prefill.context_features
    draft_cache, drafted_upto, start = None, 0, n
    result = TreeResult(tokens=[anchor])
    masks = torch.full((1, gamma - 1), drafter.config.mask_token_id)

    while len(result.tokens) < max_new_tokens and find_stop(result.tokens, stop_token_ids, 0, max_new_tokens) is None:
        generator.manual_seed(round_seed(seed, len(result.tokens)))
        backbone = drafter.forward_backbone(
            block_ids=torch.cat((torch.tensor([[anchor]]), masks), dim=1),
            block_position_ids=torch.arange(start, start + gamma)[None],
            context_features=new_context,
            context_position_ids=torch.arange(drafted_upto, start)[None],
            past_context=draft_cache,
        )
        draft_cache, drafted_upto = backbone.present_context, start
        tree = build_tree(drafter, backbone.hidden[0], anchor, num_nodes=num_nodes, mode=mode,
                          score_temperature=score_temperature, top_k=top_k, sps=sps)
        if draw == "sampled":  # the shape (and its budget) is fixed before any token is drawn
            tree = sample_tree(drafter, backbone.hidden[0], tree, temperature=temperature, generator=generator,
                               mode=mode)

        verify = run_tree(target, tree, target_cache, start)
        verdict = accept_tree(tree, verify.logits[0], temperature=temperature, generator=generator,
                              max_depth=gamma)
        stats = TreeRoundStats(
            start=start,
            anchor=anchor,
            tree_nodes=tree.num_nodes,
            tree_depth=tree.max_depth,
            expected_acceptance=sum(tree.scores),
            accepted_drafts=verdict.accepted_drafts,
            acceptance_length=verdict.accepted_drafts + 1,
        )
        result.rounds.append(stats)
        if observer is not None:
            observer(stats, tree)
        target_cache = compact_kv_cache(verify.present, start, verdict.path)
        new_context = path_features(verify.context_features, verdict.path)
        result.tokens += verdict.tokens
        start += len(verdict.path)
        anchor = verdict.bonus

    result.tokens, reason = truncate_at_stop(result.tokens, stop_token_ids, max_new_tokens)
    result.stopped_by_token = reason == "stop"
    return result
