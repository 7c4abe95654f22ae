"""Model configs parsed from checkpoint `config.json` files and validated at the boundary.

Target configs use Hugging Face field names (Qwen3, Llama); drafter configs use DeepSpec's
field names exactly (`block_size`, `target_layer_ids`, `markov_rank`, ...), so a folder written
by DeepSpec's `save_pretrained` loads unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed or does not match its config."""


class IncompatibleDrafterError(ValueError):
    """A drafter was not trained for the given target (vocab, hidden size, layer ids...)."""


# Architecture deltas over the one decoder in `target.py`: Llama is Qwen3 without q/k norms.
_ARCHITECTURES = {"qwen3": {"qk_norm": True}, "llama": {"qk_norm": False}}
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


def read_config_json(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: a checkpoint folder needs config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _require(data: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
    if key not in data or data[key] is None:
        raise CheckpointError(f"{source}: required field '{key}' is missing")
    value = data[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise CheckpointError(f"{source}: '{key}' must be a positive integer, got {value!r}")
    return value


def _rope_theta(data: dict[str, Any], source: str) -> float:
    # transformers >= 5 nests RoPE under `rope_parameters`; older configs use `rope_theta`
    # and `rope_scaling`. Only plain RoPE is implemented; anything else is refused, not ignored.
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{source}: rope_type '{rope_type}' is not supported (only 'default')")
    return float(params.get("rope_theta", data.get("rope_theta", 10000.0)))


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class DecoderConfig:
    """Fields shared by the target decoder and the drafter's layers."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    qk_norm: bool = True


def _decoder_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    model_type = data.get("model_type", "qwen3")
    if model_type not in _ARCHITECTURES:
        raise CheckpointError(
            f"{source}: model_type '{model_type}' is not supported (supported: {sorted(_ARCHITECTURES)})"
        )
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act '{act}' is not supported (only 'silu')")
    if data.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias is not supported")
    if data.get("use_sliding_window"):
        raise CheckpointError(f"{source}: sliding-window attention is not supported")
    heads = _require(data, "num_attention_heads", source)
    kv_heads = int(data.get("num_key_value_heads") or heads)
    hidden = _require(data, "hidden_size", source)
    if heads % kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = int(data.get("head_dim") or hidden // heads)
    if head_dim % 2:
        raise CheckpointError(f"{source}: head_dim {head_dim} must be even for RoPE")
    return {
        "vocab_size": _require(data, "vocab_size", source),
        "hidden_size": hidden,
        "intermediate_size": _require(data, "intermediate_size", source),
        "num_hidden_layers": _require(data, "num_hidden_layers", source),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(data, source),
        "attention_bias": bool(data.get("attention_bias", False)),
        "qk_norm": _ARCHITECTURES[model_type]["qk_norm"],
    }


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
        return cls(
            **_decoder_fields(data, source),
            model_type=data.get("model_type", "qwen3"),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            max_position_embeddings=int(data.get("max_position_embeddings", 32768)),
            eos_token_ids=_token_ids(data.get("eos_token_id")),
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
        fields = _decoder_fields(data, source)
        mask_token_id = data.get("mask_token_id")
        if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < fields["vocab_size"]:
            raise CheckpointError(f"{source}: mask_token_id {mask_token_id!r} is not a token id of the vocab")
        return cls(
            **fields,
            block_size=_require(data, "block_size", source),
            target_layer_ids=tuple(ids),
            num_target_layers=_require(data, "num_target_layers", source),
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
