"""Reading a checkpoint's `config.json`: the fields each model family sets on the one decoder
(`config.DecoderConfig`), validated at the boundary, and what every family's reader shares (errors,
required fields, RoPE, per-layer attention layouts).

Target configs use Hugging Face field names (Qwen3, Llama, Gemma-4); drafter configs use DeepSpec's
field names exactly, so a folder written by DeepSpec's `save_pretrained` loads unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed or does not match its config."""


class IncompatibleDrafterError(ValueError):
    """A drafter was not trained for the given target (vocab, hidden size, layer ids...)."""


# Architecture deltas over the one decoder in `target.py`: Llama is Qwen3 without q/k norms;
# Gemma-4 (`gemma4_decoder_fields` below) sets the remaining `DecoderConfig` fields.
_ARCHITECTURES = {"qwen3": {"qk_norm": True}, "llama": {"qk_norm": False}}
GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_unified", "gemma4_text")
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


def require(data: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
    if key not in data or data[key] is None:
        raise CheckpointError(f"{source}: required field '{key}' is missing")
    value = data[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise CheckpointError(f"{source}: '{key}' must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1's `rope_type: llama3`: long wavelengths slowed by `factor`, short ones kept, the
    band between blended (applied to the frequencies in `layers.RotaryEmbedding`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(data: dict[str, Any], source: str) -> tuple[float, Llama3RopeScaling | None]:
    """(theta, scaling). transformers >= 5 nests RoPE under `rope_parameters`; older configs use
    `rope_theta` and `rope_scaling`. Plain and Llama-3.1 RoPE are implemented; anything else is
    refused, not ignored."""
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", data.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"{source}: rope_type '{rope_type}' is not supported (only 'default' and 'llama3')")
    missing = [name for name in _LLAMA3_FIELDS if not isinstance(params.get(name), int | float)]
    if missing:
        raise CheckpointError(f"{source}: llama3 RoPE scaling needs numeric {', '.join(missing)}")
    scaling = Llama3RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                                float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    if scaling.factor < 1 or not 0 < scaling.low_freq_factor < scaling.high_freq_factor \
            or scaling.original_max_position_embeddings <= 0:
        raise CheckpointError(f"{source}: llama3 RoPE scaling {params} is not valid (factor >= 1, "
                              "0 < low_freq_factor < high_freq_factor, original_max_position_embeddings > 0)")
    return theta, scaling


def token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class AttentionLayout:
    """What one layer's attention looks like (Gemma-4 mixes two layouts in one model)."""

    head_dim: int
    num_key_value_heads: int
    rope_theta: float
    rotary_pairs: int  # frequency pairs that rotate: head_dim // 2, fewer for partial RoPE
    sliding_window: int | None = None  # a query sees the last `sliding_window` positions (itself included)
    keys_are_values: bool = False  # no v_proj: V is made from the (pre-norm) key projection
    rope_scaling: Llama3RopeScaling | None = None

    def to_json(self) -> dict[str, Any]:
        return {"head_dim": self.head_dim, "num_kv_heads": self.num_key_value_heads,
                "sliding_window": self.sliding_window, "keys_are_values": self.keys_are_values}


def decoder_fields(data: dict[str, Any], source: str, *, drafter: bool = False) -> dict[str, Any]:
    model_type = data.get("model_type", "qwen3")
    if model_type in GEMMA4_MODEL_TYPES:
        return _gemma4_decoder_fields(data, source, all_global=drafter)
    if model_type not in _ARCHITECTURES:
        raise CheckpointError(
            f"{source}: model_type '{model_type}' is not supported "
            f"(supported: {sorted([*_ARCHITECTURES, 'gemma4'])})"
        )
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: hidden_act '{act}' is not supported (only 'silu')")
    if data.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias is not supported")
    if data.get("use_sliding_window"):
        raise CheckpointError(f"{source}: sliding-window attention is not supported")
    heads = require(data, "num_attention_heads", source)
    kv_heads = int(data.get("num_key_value_heads") or heads)
    hidden = require(data, "hidden_size", source)
    if heads % kv_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = int(data.get("head_dim") or hidden // heads)
    if head_dim % 2:
        raise CheckpointError(f"{source}: head_dim {head_dim} must be even for RoPE")
    theta, scaling = _rope(data, source)
    return {
        "vocab_size": require(data, "vocab_size", source),
        "hidden_size": hidden,
        "intermediate_size": require(data, "intermediate_size", source),
        "num_hidden_layers": require(data, "num_hidden_layers", source),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": bool(data.get("attention_bias", False)),
        "qk_norm": _ARCHITECTURES[model_type]["qk_norm"],
    }


_GEMMA4_LAYER_TYPES = ("sliding_attention", "full_attention")
_GEMMA4_LAYER_OVERRIDES = {"head_dim", "num_key_value_heads"}


def _gemma4_layer_overrides(data: dict[str, Any], source: str, layers: int, all_global: bool
                            ) -> dict[int, dict[str, int]] | None:
    """`per_layer_config` (how newer transformers save the global layers' dims) by layer index, or
    None. A drafter's is its target's (target indices): all must agree, and give every draft layer."""
    raw = data.get("per_layer_config")
    if not raw:
        return None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) and v.keys() <= _GEMMA4_LAYER_OVERRIDES
                                            for v in raw.values()):
        raise CheckpointError(f"{source}: 'per_layer_config' {raw} is not supported (only layer index -> "
                              f"{sorted(_GEMMA4_LAYER_OVERRIDES)} overrides)")
    by_layer = {int(k): v for k, v in raw.items()}
    if not all_global:
        return by_layer
    distinct = {tuple(sorted(v.items())) for v in by_layer.values()}
    if len(distinct) != 1:
        raise CheckpointError(f"{source}: per_layer_config gives the global layers different dims {sorted(distinct)}")
    shared = dict(distinct.pop())
    return {i: shared for i in range(layers)}


def gemma4_text_config(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A Gemma4ForConditionalGeneration's `text_config`; vision and audio towers are refused."""
    if data.get("model_type") == "gemma4_text":
        return data
    towers = [name for name in ("vision_config", "audio_config") if data.get(name)]
    if towers:
        raise CheckpointError(f"{source}: Gemma-4 {' and '.join(towers)} towers are not supported "
                              "(text-only targets: a checkpoint saved with vision_config = audio_config = null)")
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{source}: a '{data.get('model_type')}' config needs a 'text_config' object")
    return {"tie_word_embeddings": data.get("tie_word_embeddings", True), **text}


def _gemma4_decoder_fields(data: dict[str, Any], source: str, *, all_global: bool) -> dict[str, Any]:
    """Gemma-4's `DecoderConfig` deltas (see the fields). A drafter (`all_global`) has global-style
    layers whatever its `layer_types` say, as DeepSpec builds them."""
    unsupported = {
        "MoE blocks (enable_moe_block)": data.get("enable_moe_block"),
        "per-layer input embeddings (hidden_size_per_layer_input)": data.get("hidden_size_per_layer_input"),
        "KV sharing across layers (num_kv_shared_layers)": data.get("num_kv_shared_layers"),
        "double-wide MLPs (use_double_wide_mlp)": data.get("use_double_wide_mlp"),
        "attention-logit soft-capping (attn_logit_softcapping)": data.get("attn_logit_softcapping"),
    }
    refused = [name for name, value in unsupported.items() if value]
    if refused:
        raise CheckpointError(f"{source}: Gemma-4 {', '.join(refused)} not supported (dense text decoders only, "
                              "as DeepSpec's Gemma-4 drafter requires)")
    act = data.get("hidden_activation") or data.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise CheckpointError(f"{source}: hidden_activation '{act}' is not supported (only 'gelu_pytorch_tanh')")
    heads, hidden = require(data, "num_attention_heads", source), require(data, "hidden_size", source)
    layers = require(data, "num_hidden_layers", source)
    kv_heads = int(data.get("num_key_value_heads") or heads)
    head_dim = int(data.get("head_dim") or hidden // heads)
    types = ["full_attention"] * layers if all_global else data.get("layer_types")
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(_GEMMA4_LAYER_TYPES):
        raise CheckpointError(f"{source}: 'layer_types' must list {layers} entries from {_GEMMA4_LAYER_TYPES}")
    rope = data.get("rope_parameters") or {}
    overrides = _gemma4_layer_overrides(data, source, layers, all_global)

    def layout(i: int, kind: str) -> AttentionLayout:
        params = rope.get(kind) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "proportional") or float(params.get("factor", 1.0)) != 1.0:
            raise CheckpointError(f"{source}: {kind} rope {params} is not supported "
                                  "(only 'default' and unscaled 'proportional')")
        is_global = kind == "full_attention"
        k_eq_v = is_global and bool(data.get("attention_k_eq_v"))
        if overrides is not None:  # newer transformers save the global layers' dims per layer
            dim = int(overrides.get(i, {}).get("head_dim", head_dim))
            kvh = int(overrides.get(i, {}).get("num_key_value_heads", kv_heads))
        else:  # as transformers 5.10: global_head_dim defaults to 512 when absent, null = head_dim
            dim = int(data.get("global_head_dim", 512) or head_dim) if is_global else head_dim
            kvh = int(data.get("num_global_key_value_heads") or kv_heads) if k_eq_v else kv_heads
        if heads % kvh or dim % 2:
            raise CheckpointError(f"{source}: {kind}: {heads} heads over {kvh} KV heads of dim {dim} do not fit")
        fraction = float(params.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
        return AttentionLayout(
            head_dim=dim, num_key_value_heads=kvh, rope_theta=float(params.get("rope_theta", 10000.0)),
            rotary_pairs=int(fraction * dim // 2),
            sliding_window=None if is_global else require(data, "sliding_window", source),
            keys_are_values=k_eq_v,
        )

    layouts = tuple(layout(i, kind) for i, kind in enumerate(types))
    first = layouts[0]
    cap = data.get("final_logit_softcapping")
    return {
        "vocab_size": require(data, "vocab_size", source),
        "hidden_size": hidden,
        "intermediate_size": require(data, "intermediate_size", source),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": first.num_key_value_heads,  # layer 0's; `layer_layouts` has every layer's
        "head_dim": first.head_dim,
        "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "rope_theta": first.rope_theta,
        "attention_bias": bool(data.get("attention_bias", False)),
        "qk_norm": True,
        "hidden_act": act,
        "sandwich_norm": True,
        "value_norm": True,
        "embedding_scale": hidden**0.5,
        "attention_scale": 1.0,
        "final_logit_softcapping": None if cap is None else float(cap),
        "layer_layouts": layouts,
    }

