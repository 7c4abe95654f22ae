"""The DSpark drafter (DFlash when `markov_rank == 0` and there is no confidence head).

Parallel backbone: the target's context features are projected once (`fc` + `hidden_norm`)
and injected as extra keys/values into every draft layer; the block — anchor plus γ−1 mask
tokens — attends bidirectionally to itself and to all cached context. The context keys/values
are the draft-side cache: they grow by the accepted tokens' features each round, while the
block's own keys/values are dropped after the forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint import load_weights, read_tensors
from .config import CheckpointError, DrafterConfig, TargetConfig, check_drafter_fits_target
from .heads import MARKOV_HEADS, ConfidenceHead
from .layers import RMSNorm, RotaryEmbedding, attend
from .target import DecoderLayer, KVCache, TargetModel, empty_kv_cache, softcap

SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


@dataclass
class BackboneOutput:
    """B = batch, γ = block size, H = hidden, C = cached + new context positions."""

    hidden: torch.Tensor  # [B, γ, H] after the final norm
    present_context: KVCache  # per draft layer [B, kv_heads, C, hd]


class DraftLayer(DecoderLayer):
    """A decoder layer (same parameters) whose keys/values are the injected context + the block."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,  # [B, γ, H] block stream
        context: torch.Tensor,  # [B, Tc, H] projected new context rows (not layer-normed)
        block_rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, 1, γ, hd]
        context_rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, 1, Tc, hd]
        past_context: tuple[torch.Tensor, torch.Tensor],  # [B, kvh, Pc, hd]
        mask: torch.Tensor | None,  # [B, 1, γ, Pc+Tc+γ] bool or None (all visible)
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, *block_rope)
        ctx_k, ctx_v = self.self_attn.keys_values(context, *context_rope)
        ctx_k = torch.cat((past_context[0], ctx_k), dim=2)
        ctx_v = torch.cat((past_context[1], ctx_v), dim=2)
        blk_k, blk_v = self.self_attn.keys_values(h, *block_rope)
        k = torch.cat((ctx_k, blk_k), dim=2)
        v = torch.cat((ctx_v, blk_v), dim=2)
        return self.add_attention(x, attend(q, k, v, mask, self.self_attn.scale)), (ctx_k, ctx_v)


class DSparkDrafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.fc = nn.Linear(config.context_feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, layout) for layout in config.layouts)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.markov_head = MARKOV_HEADS[config.markov_head_type](config) if config.has_markov_head else None
        self.confidence_head = ConfidenceHead(config) if config.enable_confidence_head else None
        # Every draft layer has one layout (Gemma-4 drafters: all global-style).
        self.rotary = RotaryEmbedding.for_layout(config.layout(0))

    # -- parallel backbone ------------------------------------------------------------------
    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """[B, Tc, F] target features -> [B, Tc, H]."""
        return self.hidden_norm(self.fc(context_features))

    def empty_context_cache(self, batch: int, dtype: torch.dtype = torch.float32) -> KVCache:
        return empty_kv_cache(self.config, batch, dtype)

    def forward_backbone(
        self,
        *,
        block_ids: torch.Tensor,  # [B, γ] anchor + mask tokens
        block_position_ids: torch.Tensor,  # [B, γ]
        context_features: torch.Tensor,  # [B, Tc, F] features of context rows not yet cached
        context_position_ids: torch.Tensor,  # [B, Tc]
        past_context: KVCache | None = None,  # per layer [B, kvh, Pc, hd]
        attention_mask: torch.Tensor | None = None,  # [B, 1, γ, Pc+Tc+γ] bool; None = all visible
    ) -> BackboneOutput:
        x = self.embed_tokens(block_ids)
        if self.config.embedding_scale != 1.0:
            x = x * self.config.embedding_scale
        if past_context is None:
            past_context = self.empty_context_cache(block_ids.shape[0], x.dtype)
        context = self.project_context(context_features)
        block_rope = self.rotary(block_position_ids, x.dtype)
        context_rope = self.rotary(context_position_ids, x.dtype)
        present: KVCache = []
        for layer, past in zip(self.layers, past_context, strict=True):
            x, kv = layer(x, context, block_rope, context_rope, past, attention_mask)
            present.append(kv)
        return BackboneOutput(hidden=self.norm(x), present_context=present)

    # -- sequential heads -------------------------------------------------------------------
    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V]; soft-capped where the family caps (the Markov bias is added after)."""
        return softcap(self.lm_head(hidden), self.config.final_logit_softcapping)

    def initial_head_state(self, hidden_slot: torch.Tensor) -> torch.Tensor | None:
        return self.markov_head.initial_state(hidden_slot) if self.markov_head is not None else None

    def head_step(
        self,
        *,
        hidden: torch.Tensor,  # [N, H] one block slot
        base_logits: torch.Tensor,  # [N, V] = base_logits(hidden)
        prev_ids: torch.Tensor,  # [N] the token before this slot (anchor for slot 0)
        state: torch.Tensor | None,  # RNN state [N, r] or None
        confidence: bool = True,  # False: the confidence logit is left for `block_confidence`
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One slot of the sequential head -> corrected logits [N, V], confidence logit [N] or
        None, next state."""
        if self.markov_head is None:
            logits, prev_embedding = base_logits, None
        else:
            prev_embedding = self.markov_head.markov_w1(prev_ids)
            bias, state = self.markov_head.step(hidden, prev_embedding, state)
            logits = base_logits + bias
        logit = None
        if self.confidence_head is not None and confidence:
            logit = self.confidence_head(hidden, prev_embedding)
        return logits, logit, state

    def block_confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """The confidence logits of a whole block at once, its tokens known: hidden [B, γ, H], prev_ids [B, γ]
        (each slot's previous token) -> [B, γ], what `head_step` gives slot by slot."""
        prev_embedding = None if self.markov_head is None else self.markov_head.markov_w1(prev_ids)
        return self.confidence_head(hidden, prev_embedding)

    def teacher_forced_heads(
        self, hidden: torch.Tensor, prev_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All slots with known previous tokens: hidden [B, γ, H], prev_ids [B, γ] ->
        corrected logits [B, γ, V], confidence logits [B, γ] or None."""
        base = self.base_logits(hidden)
        state = self.initial_head_state(hidden[:, 0])
        logits, confidences = [], []
        for k in range(hidden.shape[1]):
            step_logits, conf, state = self.head_step(
                hidden=hidden[:, k], base_logits=base[:, k], prev_ids=prev_ids[:, k], state=state
            )
            logits.append(step_logits)
            confidences.append(conf)
        conf_out = torch.stack(confidences, dim=1) if self.confidence_head is not None else None
        return torch.stack(logits, dim=1), conf_out

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        *,
        target: TargetModel | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> DSparkDrafter:
        """Load a DeepSpec drafter folder. With `target`, the drafter is checked against it and
        may omit `embed_tokens`/`lm_head`, which are then shared with the target (as DeepSpec
        copies them from the target at initialisation)."""
        config = DrafterConfig.from_folder(folder)
        if target is not None:
            check_drafter_fits_target(config, target.config)
        model = cls(config)
        tensors = read_tensors(folder)
        missing_shared = [k for k in SHARED_WITH_TARGET if k not in tensors]
        if missing_shared and target is None:
            raise CheckpointError(
                f"{folder} has no {missing_shared}: this drafter shares them with its target, "
                "so load it with target=..."
            )
        load_weights(model, tensors, source=str(folder), optional=missing_shared)
        if target is not None and "embed_tokens.weight" in missing_shared:
            model.embed_tokens.weight = target.embed_tokens.weight
        if target is not None and "lm_head.weight" in missing_shared:
            model.lm_head.weight = target.lm_head.weight
        return model.to(dtype).eval()


def load_pair(
    target_dir: str | Path, drafter_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[TargetModel, DSparkDrafter]:
    """Target and drafter, checked against each other before any weight is read."""
    drafter_config = DrafterConfig.from_folder(drafter_dir)
    check_drafter_fits_target(drafter_config, TargetConfig.from_folder(target_dir))
    target = TargetModel.from_pretrained(target_dir, drafter_config.target_layer_ids, dtype)
    return target, DSparkDrafter.from_pretrained(drafter_dir, target=target, dtype=dtype)
