"""Model configs: the one decoder's fields (`DecoderConfig`), a target's (`TargetConfig`) and a DeepSpec
drafter's (`DrafterConfig`), read from checkpoint `config.json` files by `config_fields`, and whether a drafter
fits a target.

Target configs use Hugging Face field names (Qwen3, Llama, Gemma-4); drafter configs use DeepSpec's field
names exactly (`block_size`, `target_layer_ids`, `markov_rank`, ...), so a folder written by DeepSpec's
`save_pretrained` loads unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config_fields import (
    GEMMA4_MODEL_TYPES,
    MARKOV_HEAD_TYPES,
    AttentionLayout,
    CheckpointError,
    IncompatibleDrafterError,
    Llama3RopeScaling,
    decoder_fields,
    gemma4_text_config,
    read_config_json,
    require,
    token_ids,
)

__all__ = ["AttentionLayout", "CheckpointError", "DecoderConfig", "DrafterConfig", "IncompatibleDrafterError",
           "Llama3RopeScaling", "TargetConfig", "check_drafter_fits_target", "read_config_json"]


@dataclass(frozen=True)
class DecoderConfig:
    """Fields shared by the target decoder and the drafter's layers (defaults: Qwen3's)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    attention_bias: bool = False
    qk_norm: bool = True
    hidden_act: str = "silu"  # Gemma-4's deltas from here on; "gelu_pytorch_tanh"
    sandwich_norm: bool = False  # norms before and after attention and MLP, then a per-layer scalar
    value_norm: bool = False  # a weightless RMSNorm on V per head
    embedding_scale: float = 1.0  # input embeddings are multiplied by it
    attention_scale: float | None = None  # score scale; None = 1/sqrt(head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    layer_layouts: tuple[AttentionLayout, ...] = ()  # per layer; () = every layer from the fields above

    def layout(self, layer: int) -> AttentionLayout:
        if self.layer_layouts:
            return self.layer_layouts[layer]
        return AttentionLayout(self.head_dim, self.num_key_value_heads, self.rope_theta, self.head_dim // 2,
                               rope_scaling=self.rope_scaling)

    @property
    def layouts(self) -> tuple[AttentionLayout, ...]:
        return tuple(self.layout(i) for i in range(self.num_hidden_layers))

    @property
    def uniform_attention(self) -> bool:
        """Every layer has the same K/V shape, no window and separate K and V projections."""
        first = self.layout(0)
        return all(lay == first for lay in self.layouts) and first.sliding_window is None \
            and not first.keys_are_values



@dataclass(frozen=True)
class TargetConfig(DecoderConfig):
    """A Hugging Face causal LM config (Qwen3ForCausalLM, LlamaForCausalLM)."""

    model_type: str = "qwen3"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "target config") -> TargetConfig:
        model_type = data.get("model_type", "qwen3")
        if model_type in GEMMA4_MODEL_TYPES:
            data = gemma4_text_config(data, source)  # Gemma4ForConditionalGeneration nests it
        return cls(
            **decoder_fields(data, source),
            model_type=model_type,
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
            eos_token_ids=token_ids(data.get("eos_token_id")),
            pad_token_id=data.get("pad_token_id"),
            bos_token_id=data.get("bos_token_id"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> TargetConfig:
        return cls.from_dict(read_config_json(folder), source=f"{Path(folder) / 'config.json'}")


@dataclass(frozen=True)
class DrafterConfig(DecoderConfig):
    """A DeepSpec DSpark (or DFlash: `markov_rank == 0`, no confidence head) drafter config."""

    block_size: int = 7
    target_layer_ids: tuple[int, ...] = field(default_factory=tuple)
    num_target_layers: int = 0
    mask_token_id: int = 0
    num_anchors: int = 1
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False

    @property
    def has_markov_head(self) -> bool:
        return self.markov_rank > 0

    @property
    def context_feature_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "drafter config") -> DrafterConfig:
        ids = data.get("target_layer_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise CheckpointError(f"{source}: 'target_layer_ids' must be a non-empty list of integers")
        rank = int(data.get("markov_rank") or 0)
        head_type = data.get("markov_head_type") or "vanilla"
        if rank < 0:
            raise CheckpointError(f"{source}: markov_rank must be >= 0, got {rank}")
        if rank and head_type not in MARKOV_HEAD_TYPES:
            raise CheckpointError(
                f"{source}: markov_head_type '{head_type}' is unknown (expected one of {MARKOV_HEAD_TYPES})"
            )
        confidence = bool(data.get("enable_confidence_head", False))
        with_markov = confidence and bool(data.get("confidence_head_with_markov", False))
        if with_markov and not rank:
            raise CheckpointError(f"{source}: confidence_head_with_markov needs markov_rank > 0")
        fields = decoder_fields(data, source, drafter=True)
        mask_token_id = data.get("mask_token_id")
        if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < fields["vocab_size"]:
            raise CheckpointError(f"{source}: mask_token_id {mask_token_id!r} is not a token id of the vocab")
        return cls(
            **fields,
            block_size=require(data, "block_size", source),
            target_layer_ids=tuple(ids),
            num_target_layers=require(data, "num_target_layers", source),
            mask_token_id=mask_token_id,
            num_anchors=int(data.get("num_anchors") or 1),
            markov_rank=rank,
            markov_head_type=head_type,
            enable_confidence_head=confidence,
            confidence_head_with_markov=with_markov,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> DrafterConfig:
        return cls.from_dict(read_config_json(folder), source=f"{Path(folder) / 'config.json'}")


def check_drafter_fits_target(drafter: DrafterConfig, target: TargetConfig) -> None:
    """Refuse a drafter that was not trained against this target, naming the mismatch."""
    problems = []
    if drafter.sandwich_norm != target.sandwich_norm:  # Gemma-4 layers vs Qwen3/Llama layers
        problems.append(f"a {'Gemma-4' if drafter.sandwich_norm else 'Qwen3-style'} drafter for a "
                        f"'{target.model_type}' target")
    if drafter.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {drafter.vocab_size} != target's {target.vocab_size}")
    if drafter.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {drafter.hidden_size} != target's {target.hidden_size}")
    if drafter.num_target_layers != target.num_hidden_layers:
        problems.append(
            f"num_target_layers {drafter.num_target_layers} != target's num_hidden_layers "
            f"{target.num_hidden_layers}"
        )
    last = target.num_hidden_layers - 1
    bad = [i for i in drafter.target_layer_ids if not -1 <= i < last]
    if bad:
        problems.append(
            f"target_layer_ids {bad} out of range: ids must lie in [-1, {last - 1}] "
            f"(-1 = embeddings; the final layer {last} is post-norm and refused)"
        )
    if problems:
        raise IncompatibleDrafterError("drafter does not fit the target: " + "; ".join(problems))
