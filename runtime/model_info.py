"""What the decode loop needs to know about a model pair, from the PyTorch models or export.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the serving front end reads a ModelInfo without torch
    from dspark.models import DSparkDrafter, TargetModel

from .capacity import CacheShape


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_positions: int
    block_size: int  # γ draft slots per block
    mask_token_id: int
    target_cache: CacheShape
    drafter_cache: CacheShape
    context_feature_size: int
    head_state_size: int  # RNN Markov head state width, 0 for stateless heads
    has_heads: bool  # Markov and/or confidence head graphs exist (False: DFlash)
    has_confidence: bool
    lm_head_in_backbone: bool  # the backbone returns base_logits
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_models(cls, target: TargetModel, drafter: DSparkDrafter,
                    lm_head_in_backbone: bool = True) -> ModelInfo:
        tc, dc = target.config, drafter.config
        return cls(
            vocab_size=tc.vocab_size, max_positions=tc.max_position_embeddings,
            block_size=dc.block_size, mask_token_id=dc.mask_token_id,
            target_cache=_cache_shape(tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim,
                                      [lay.to_json() for lay in tc.layouts]),
            drafter_cache=_cache_shape(dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim,
                                       [lay.to_json() for lay in dc.layouts]),
            context_feature_size=dc.context_feature_size,
            head_state_size=dc.markov_rank if dc.has_markov_head and dc.markov_head_type == "rnn" else 0,
            has_heads=dc.has_markov_head or dc.enable_confidence_head,
            has_confidence=dc.enable_confidence_head,
            lm_head_in_backbone=lm_head_in_backbone,
            eos_token_ids=tuple(tc.eos_token_ids),
        )

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> ModelInfo:
        t, d = manifest["target"], manifest["drafter"]
        return cls(
            vocab_size=t["vocab_size"], max_positions=t["max_position_embeddings"],
            block_size=d["block_size"], mask_token_id=d["mask_token_id"],
            target_cache=_cache_shape(t["num_layers"], t["num_kv_heads"], t["head_dim"], t.get("attention_layers")),
            drafter_cache=_cache_shape(d["num_layers"], d["num_kv_heads"], d["head_dim"], d.get("attention_layers")),
            context_feature_size=t["context_feature_size"],
            head_state_size=d["markov_rank"] if d["markov_head_type"] == "rnn" else 0,
            has_heads=d["markov_head_type"] is not None or d["enable_confidence_head"],
            has_confidence=d["enable_confidence_head"],
            lm_head_in_backbone=manifest["lm_head_in_backbone"],
            eos_token_ids=tuple(t["eos_token_ids"]),
        )


def _cache_shape(layers: int, kv_heads: int, head_dim: int, attention_layers: list[dict] | None) -> CacheShape:
    """One K/V shape for all layers, or each layer's own (export.json's `attention_layers`, Gemma-4)."""
    per_layer = tuple((lay["num_kv_heads"], lay["head_dim"]) for lay in attention_layers or ())
    if all(dims == (kv_heads, head_dim) for dims in per_layer):
        per_layer = ()
    return CacheShape(layers, kv_heads, head_dim, per_layer)
