"""The reference decoder: one request, chain drafting, PyTorch models, every step explicit.

It is the yardstick the production runtime is tested against, and it follows DeepSpec's
semantics exactly (see ../shared/golden/*/README.md):

- the anchor (last committed token) is the first prediction position: block slot k predicts
  the token at position start+k+1, so a block of γ slots verifies γ+1 tokens;
- the drafter's cache holds context keys/values only (positions < start); each round feeds the
  features of the tokens the target verified and kept in the previous round;
- the target verifies [anchor, d_1..d_k] on top of its cache of positions < start, and its
  cache is cropped back to the accepted prefix (rollback of rejected tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dspark.models import DSparkDrafter, TargetModel, crop_kv_cache

from .prefix_scheduler import threshold_length
from .proposer import propose_block
from .rejection import verify_chain
from .requests import RequestError, find_stop, truncate_at_stop, validate_request
from .sampling import round_generator, round_seed, sample_token


@dataclass
class RoundStats:
    start: int  # position of the anchor
    anchor: int
    draft_tokens: list[int]  # all γ drafted tokens, before any truncation
    proposal_length: int  # k draft tokens sent to verification
    accepted_drafts: int  # a
    acceptance_length: int  # a + 1: the bonus token counts, as in DeepSpec and the paper
    confidence_logits: list[float] | None  # all γ slots, pre-sigmoid


@dataclass
class RoundTensors:
    """What one round computed, for tracing and debugging (B = 1)."""

    new_context_features: torch.Tensor  # [1, Tc, F] rows fed to the drafter this round
    context_position_ids: torch.Tensor  # [1, Tc]
    block_hidden: torch.Tensor  # [1, γ, H]
    draft_logits: torch.Tensor  # [1, γ, V] Markov-corrected
    verify_input_ids: torch.Tensor  # [1, k+1]
    verify_logits: torch.Tensor  # [1, k+1, V]


@dataclass
class SpeculativeResult:
    tokens: list[int]  # generated tokens, prompt excluded
    rounds: list[RoundStats] = field(default_factory=list)
    stopped_by_token: bool = False

    @property
    def mean_acceptance_length(self) -> float:
        return sum(r.acceptance_length for r in self.rounds) / max(len(self.rounds), 1)


@torch.no_grad()
def autoregressive_generate(
    target: TargetModel,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] = (),
) -> list[int]:
    """Plain target-only decoding with a KV cache: the output speculative decoding must match."""
    cfg = target.config
    prompt_ids = validate_request(prompt_ids, vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                                  max_new_tokens=max_new_tokens, temperature=temperature)
    generator = round_generator(seed)
    n = len(prompt_ids)
    out = target(torch.tensor([prompt_ids]), torch.arange(n)[None])
    tokens: list[int] = []
    while True:
        generator.manual_seed(round_seed(seed, len(tokens)))
        token = sample_token(out.logits[:, -1], temperature, generator)
        tokens.append(int(token))
        if len(tokens) >= max_new_tokens or tokens[-1] in stop_token_ids:
            return tokens
        position = torch.tensor([[n + len(tokens) - 1]])
        out = target(token[:, None], position, past_key_values=out.present)


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: DSparkDrafter,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    block_size: int | None = None,
    confidence_threshold: float = 0.0,
    stop_token_ids: Sequence[int] = (),
    observer: Callable[[RoundStats, RoundTensors], None] | None = None,
) -> SpeculativeResult:
    """DSpark chain decoding of one request.

    `confidence_threshold` > 0 verifies only the draft prefix before the first slot whose
    confidence σ(c_k) is below it (needs a confidence head); 0 verifies the whole block.
    `observer`, if given, is called after every round with its stats and tensors.
    """
    cfg = target.config
    prompt_ids = validate_request(prompt_ids, vocab_size=cfg.vocab_size, max_positions=cfg.max_position_embeddings,
                                  max_new_tokens=max_new_tokens, temperature=temperature)
    gamma = drafter.config.block_size if block_size is None else block_size
    if gamma < 1:
        raise RequestError(f"block_size must be >= 1, got {gamma}")
    if not 0.0 <= confidence_threshold < 1.0:
        raise RequestError(f"confidence_threshold must lie in [0, 1), got {confidence_threshold}")
    if confidence_threshold > 0.0 and drafter.confidence_head is None:
        raise RequestError("confidence_threshold needs a drafter with a confidence head")

    generator = round_generator(seed)
    n = len(prompt_ids)
    prefill = target(torch.tensor([prompt_ids]), torch.arange(n)[None])
    anchor = sample_token(prefill.logits[:, -1], temperature, generator)  # [1]
    target_cache = prefill.present  # positions < start
    new_context = prefill.context_features  # features of positions [drafted_upto, start)
    draft_cache, drafted_upto = None, 0
    start = n
    result = SpeculativeResult(tokens=[int(anchor)])
    masks = torch.full((1, gamma - 1), drafter.config.mask_token_id)

    while len(result.tokens) < max_new_tokens and find_stop(result.tokens, stop_token_ids, 0, max_new_tokens) is None:
        generator.manual_seed(round_seed(seed, len(result.tokens)))
        context_positions = torch.arange(drafted_upto, start)[None]
        backbone = drafter.forward_backbone(
            block_ids=torch.cat((anchor[:, None], masks), dim=1),
            block_position_ids=torch.arange(start, start + gamma)[None],
            context_features=new_context,
            context_position_ids=context_positions,
            past_context=draft_cache,
        )
        draft_cache, drafted_upto = backbone.present_context, start
        block = propose_block(drafter, backbone.hidden, anchor, temperature, generator)
        confidences = None if block.confidence_logits is None else block.confidence_logits[0]
        k = gamma if confidences is None else threshold_length(confidences, confidence_threshold)

        drafts = block.tokens[0, :k]
        verify_ids = torch.cat((anchor, drafts))[None]
        verify = target(
            verify_ids,
            torch.arange(start, start + k + 1)[None],
            past_key_values=target_cache,
        )
        verdict = verify_chain(
            target_logits=verify.logits[0],
            draft_tokens=drafts,
            draft_logits=block.logits[0, :k],
            temperature=temperature,
            generator=generator,
        )
        a = verdict.accepted_drafts
        stats = RoundStats(
            start=start,
            anchor=int(anchor),
            draft_tokens=block.tokens[0].tolist(),
            proposal_length=k,
            accepted_drafts=a,
            acceptance_length=a + 1,
            confidence_logits=None if confidences is None else confidences.tolist(),
        )
        result.rounds.append(stats)
        if observer is not None:
            observer(stats, RoundTensors(new_context, context_positions, backbone.hidden, block.logits,
                                         verify_ids, verify.logits))
        target_cache = crop_kv_cache(verify.present, start + a + 1)
        new_context = verify.context_features[:, : a + 1]
        result.tokens += [*drafts[:a].tolist(), verdict.bonus]
        start += a + 1
        anchor = torch.tensor([verdict.bonus])

    result.tokens, reason = truncate_at_stop(result.tokens, stop_token_ids, max_new_tokens)
    result.stopped_by_token = reason == "stop"
    return result
