"""Real-shape checkpoint fixtures, made here: the real `config.json` of a named model, random bf16
weights in sharded safetensors with an index, and a DSpark drafter as DeepSpec trains one for it.

    python -m dspark.tools.checkpoint_fixtures --model qwen3-4b --out /tmp/dspark-big/qwen3-4b
    python -m dspark.tools.checkpoint_fixtures --model qwen3-0.6b --layers 2 --out DIR   # real widths

Writes DIR/target (Hugging Face layout: config.json, model-0000i-of-0000n.safetensors,
model.safetensors.index.json) and DIR/drafter (DeepSpec layout; it omits the embedding and LM
head, which DeepSpec copies from the target). Nothing is downloaded: the configs below are the
public model cards' config.json values (Gemma-4-12B's partly inferred: see `_gemma4_12b`). Weights
are written tensor by tensor, in row chunks, so memory stays at one chunk whatever the model's size;
each tensor's values come from a generator seeded by its name (a pool of draws, tiled), so a fixture
is the same on every machine.

The drafter follows the DSpark paper's setup (5 layers, block size 7, vanilla Markov head of rank
256 with the confidence head reading it) with DeepSpec's default feature layers: evenly spaced over
target layers [1, L-3], or those its recipe names (Gemma-4-12B). With fewer target layers
(`--layers`) they are spread over [0, L-2].
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import torch

from .errors import OneLineErrors

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 40960, "model_type": "qwen3",
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    return {**_QWEN3, "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "max_window_layers": layers, "num_attention_heads": heads, "tie_word_embeddings": tied}


def _gemma4_layer_types(layers: int) -> list[str]:
    """Five sliding-window layers to one global, the last layer global."""
    return ["full_attention" if (layers - 1 - i) % 6 == 0 else "sliding_attention" for i in range(layers)]


def _gemma4_12b() -> dict[str, Any]:
    """Gemma-4-12B as a text-only Gemma4ForConditionalGeneration (transformers 5.10's field names).
    The model card gives 48 layers, width 3840, a 1024-token window, a 262,144 vocabulary, head dim
    256 (sliding) / 512 (global), 5 sliding : 1 global with the last global, RoPE theta 1e4 / 1e6
    (global: proportional, p = 0.25) and 11.95B parameters. Its head counts and MLP width are not
    in what we can read offline: 16 query heads, 8 KV heads (4 on the K = V global layers) and an
    MLP of 15,360 (Gemma-3-12B's) give 11.96B, so they are used."""
    text = {
        "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 3840, "intermediate_size": 15360,
        "num_hidden_layers": 48, "layer_types": _gemma4_layer_types(48), "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
        "attention_k_eq_v": True, "sliding_window": 1024, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06, "attention_bias": False,
        "attention_dropout": 0.0, "max_position_embeddings": 262144, "initializer_range": 0.02,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "enable_moe_block": False,
        "use_double_wide_mlp": False, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 2,
        "eos_token_id": 1, "dtype": "bfloat16",
    }
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
            "vision_config": None, "audio_config": None, "tie_word_embeddings": True, "initializer_range": 0.02,
            "dtype": "bfloat16", "transformers_version": "5.10.2"}


MODELS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    "gemma-4-12b": _gemma4_12b(),
}
# The drafter's mask token: past each tokenizer's named tokens (Qwen3, Llama); Gemma-4's is
# DeepSpec's recipe value.
MASK_TOKEN = {"qwen3": 151669, "llama": 128002, "gemma4": 4}
# Feature layers DeepSpec's recipes name instead of its default spacing (full depth only).
RECIPE_LAYER_IDS = {"gemma-4-12b": [5, 17, 29, 41, 46]}
DRAFTER_LAYERS, BLOCK_SIZE, MARKOV_RANK = 5, 7, 256
SHARD_BYTES = 2 * 2**30
_CHUNK_ELEMENTS = 2**24  # elements per write: ~32 MB of bf16
_POOL = 2**20 - 1  # random draws per tensor, tiled (odd: tiles do not line up with rows)


def deepspec_layer_ids(target_layers: int, drafter_layers: int) -> list[int]:
    """DeepSpec's default feature layers; spread over [0, L-2] when L is too small for [1, L-3]."""
    if target_layers >= drafter_layers + 3:
        if drafter_layers == 1:
            return [target_layers // 2]
        span = target_layers - 4
        return [round(1 + i * span / (drafter_layers - 1)) for i in range(drafter_layers)]
    count = min(drafter_layers, target_layers - 1)
    if count < 1:
        raise ValueError(f"a target of {target_layers} layer(s) has no layer a drafter may read (needs >= 2)")
    last = target_layers - 2
    return sorted({round(i * last / max(count - 1, 1)) for i in range(count)})


def _text(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields: Gemma-4 nests them under `text_config`."""
    return config.get("text_config") or config


def target_config(model: str, layers: int | None = None) -> dict[str, Any]:
    config = json.loads(json.dumps(MODELS[model]))  # a deep copy
    if layers is not None:
        text = _text(config)
        text["num_hidden_layers"] = layers
        if "max_window_layers" in text:
            text["max_window_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = _gemma4_layer_types(layers)
    return config


def drafter_config(target: dict[str, Any], drafter_layers: int = DRAFTER_LAYERS,
                   layer_ids: list[int] | None = None) -> dict[str, Any]:
    """The DSpark drafter DeepSpec trains for `target` (same width, heads and vocabulary). DeepSpec copies
    the target's decoder fields into it; a Gemma-4 drafter's layers are all global-style."""
    text = _text(target)
    ids = layer_ids or deepspec_layer_ids(text["num_hidden_layers"], drafter_layers)
    dspark = {
        "num_hidden_layers": len(ids), "target_layer_ids": ids, "num_target_layers": text["num_hidden_layers"],
        "block_size": BLOCK_SIZE, "mask_token_id": MASK_TOKEN[target["model_type"]],
        "markov_rank": MARKOV_RANK, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    if target["model_type"] == "gemma4":
        fields = {k: v for k, v in text.items() if k not in ("tie_word_embeddings", "dtype")}
        return {"architectures": ["Gemma4DSparkModel"], **fields, "layer_types": ["full_attention"] * len(ids),
                "target_model_type": "gemma4", "target_text_model_type": text["model_type"], **dspark}
    keep = ("attention_bias", "attention_dropout", "head_dim", "hidden_act", "hidden_size", "initializer_range",
            "intermediate_size", "max_position_embeddings", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "rope_scaling", "rope_theta", "vocab_size")
    return {
        "architectures": ["Qwen3DSparkModel" if target["model_type"] == "qwen3" else "LlamaDSparkModel"],
        "model_type": target["model_type"], **{k: text[k] for k in keep if k in text}, **dspark,
    }


def _shapes(module_factory: Callable[[], torch.nn.Module]) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a model built on the meta device (no memory)."""
    with torch.device("meta"):
        module = module_factory()
    return {name: tuple(t.shape) for name, t in module.state_dict(keep_vars=True).items()}


def target_tensors(config: dict[str, Any], drafter_ids: list[int]) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of the target's weights (no lm_head when tied)."""
    from dspark.models import TargetConfig, TargetModel
    from dspark.models.target import HF_PREFIXES

    parsed = TargetConfig.from_dict(config)
    shapes = _shapes(lambda: TargetModel(parsed, tuple(drafter_ids)))
    if parsed.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    prefix = HF_PREFIXES[0] if config["model_type"] == "gemma4" else HF_PREFIXES[-1]  # as transformers saves them
    return {(k if k.startswith("lm_head") else prefix + k): v for k, v in shapes.items()}


def drafter_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """DeepSpec names and shapes of the drafter's own weights (embedding and LM head are the target's)."""
    from dspark.models import DrafterConfig, DSparkDrafter

    parsed = DrafterConfig.from_dict(config)
    shapes = _shapes(lambda: DSparkDrafter(parsed))
    return {k: v for k, v in shapes.items() if k not in ("embed_tokens.weight", "lm_head.weight")}


def _chunks(name: str, shape: tuple[int, ...], std: float) -> Iterator[bytes]:
    """The tensor's bf16 bytes, row chunk by row chunk. Values: a pool of N(0, std) draws from a
    generator seeded by the name, tiled at a shifting offset (drawing every value is ~50x slower,
    minutes per GB on a shared CPU; a fixture needs realistic magnitudes, not independence)."""
    if len(shape) == 1:  # norms: ones, as a trained model's are near
        yield torch.ones(shape, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
        return
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    total = int(torch.Size(shape).numel())
    pool = (torch.randn(min(_POOL, total) + 1, generator=generator) * std).to(torch.bfloat16).view(torch.int16)
    row = total // shape[0]
    step = max(1, _CHUNK_ELEMENTS // row) * row
    for start in range(0, total, step):
        count = min(step, total - start)
        shift = (start // step * 7919) % (len(pool) - 1)  # a prime stride: chunks differ
        rolled = torch.cat((pool[shift:], pool[:shift]))
        reps = -(-count // len(rolled))
        yield rolled.repeat(reps)[:count].numpy().tobytes()


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], std: float) -> int:
    """One bf16 safetensors file, streamed; returns its bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as out:
        out.write(len(text).to_bytes(8, "little"))
        out.write(text)
        for name, shape in shapes.items():
            for chunk in _chunks(name, shape, std):
                out.write(chunk)
    return 8 + len(text) + offset


def write_checkpoint(folder: Path, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], *,
                     shard_bytes: int = SHARD_BYTES, progress: Callable[[str], None] | None = None) -> int:
    """config.json + shards of at most `shard_bytes` (a larger tensor gets a shard of its own) +
    the index; returns the weight bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    used = 0
    for name, shape in shapes.items():
        size = 2 * int(torch.Size(shape).numel())
        if shards[-1] and used + size > shard_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = shape
        used += size
    weight_map, total = {}, 0
    std = float(_text(config).get("initializer_range", 0.02))
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        if progress:
            progress(f"{folder.name}: writing {name} ({len(shard)} tensors)")
        write_safetensors(folder / name, shard, std)
        total += sum(2 * int(torch.Size(s).numel()) for s in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return total


def make_pair(model: str, out: Path, *, layers: int | None = None, drafter_layers: int = DRAFTER_LAYERS,
              shard_bytes: int = SHARD_BYTES, progress: Callable[[str], None] | None = None) -> dict[str, int]:
    """Write out/target and out/drafter; returns the weight bytes of each."""
    if model not in MODELS:
        raise click.UsageError(f"--model {model!r} is not one of {sorted(MODELS)}")
    target = target_config(model, layers)
    recipe = RECIPE_LAYER_IDS.get(model) if layers is None and drafter_layers == DRAFTER_LAYERS else None
    drafter = drafter_config(target, drafter_layers, recipe)
    return {
        "target": write_checkpoint(out / "target", target, target_tensors(target, drafter["target_layer_ids"]),
                                   shard_bytes=shard_bytes, progress=progress),
        "drafter": write_checkpoint(out / "drafter", drafter, drafter_tensors(drafter), shard_bytes=shard_bytes,
                                    progress=progress),
    }


@click.command("checkpoint-fixtures", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", required=True, type=click.Choice(sorted(MODELS)), help="Whose real config.json.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Writes OUT/target, OUT/drafter.")
@click.option("--layers", type=click.IntRange(min=2), help="Target layers (default: the model's): real widths, "
              "fewer layers, for tests.")
@click.option("--drafter-layers", default=DRAFTER_LAYERS, show_default=True, type=click.IntRange(min=1))
@click.option("--shard-gb", default=SHARD_BYTES / 2**30, show_default=True, type=click.FloatRange(min=0.001),
              help="Largest shard (GiB).")
def main(model: str, out: str, layers: int | None, drafter_layers: int, shard_gb: float) -> None:
    """Write a random-weight bf16 pair with MODEL's real shapes."""
    written = make_pair(model, Path(out), layers=layers, drafter_layers=drafter_layers,
                        shard_bytes=int(shard_gb * 2**30), progress=lambda m: click.echo(m, err=True))
    click.echo(f"wrote {out}: target {written['target'] / 1e9:.2f} GB, drafter {written['drafter'] / 1e9:.2f} GB "
               "(bf16 weights)")


if __name__ == "__main__":
    main()
