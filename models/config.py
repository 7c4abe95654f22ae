"""Model configs parsed from checkpoint `config.json` files and validated at the boundary.

Target configs use Hugging Face field names (Qwen3, Llama, Gemma-4); drafter configs use
DeepSpec's field names exactly (`block_size`, `target_layer_ids`, `markov_rank`, ...), so a folder
written by DeepSpec's `save_pretrained` loads unchanged. Gemma-4's fields are read in `gemma4.py`.
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


# Architecture deltas over the one decoder in `target.py`: Llama is Qwen3 without q/k norms;
# Gemma-4 (`gemma4.py`) sets the remaining `DecoderConfig` fields.
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


def _require(data: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
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


def _token_ids(value: Any) -> tuple[int, ...]:
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


def _decoder_fields(data: dict[str, Any], source: str, *, drafter: bool = False) -> dict[str, Any]:
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
    theta, scaling = _rope(data, source)
    return {
        "vocab_size": _require(data, "vocab_size", source),
        "hidden_size": hidden,
        "intermediate_size": _require(data, "intermediate_size", source),
        "num_hidden_layers": _require(data, "num_hidden_layers", source),
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


def _gemma4_text_config(data: dict[str, Any], source: str) -> dict[str, Any]:
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
    heads, hidden = _require(data, "num_attention_heads", source), _require(data, "hidden_size", source)
    layers = _require(data, "num_hidden_layers", source)
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
            sliding_window=None if is_global else _require(data, "sliding_window", source),
            keys_are_values=k_eq_v,
        )

    layouts = tuple(layout(i, kind) for i, kind in enumerate(types))
    first = layouts[0]
    cap = data.get("final_logit_softcapping")
    return {
        "vocab_size": _require(data, "vocab_size", source),
        "hidden_size": hidden,
        "intermediate_size": _require(data, "intermediate_size", source),
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
            data = _gemma4_text_config(data, source)  # Gemma4ForConditionalGeneration nests it
        return cls(
            **_decoder_fields(data, source),
            model_type=model_type,
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
        fields = _decoder_fields(data, source, drafter=True)
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
