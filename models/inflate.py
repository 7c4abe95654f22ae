"""A memory-bound COST STAND-IN for a target: the same function, N parameters' worth of cost.

The bundled demo target (5.2M parameters, 21 MB) sits in cache, so verifying 8 tokens costs
~1.8x one token and speculation has little to win; a real LLM step is memory-bound (a
Qwen3-0.6B-shaped model costs ~1.06x at 4 tokens). `inflate_checkpoint` rewrites a target
checkpoint into one with >= N parameters that computes the *same* logits and context features
(up to float rounding), so a drafter trained on the original keeps its acceptance while
each target step streams N parameters' worth of weights. It is a cost model, not a better model:
the folder's config.json carries a `dspark_standin` section saying so (`standin_label` is the
one-line form to print wherever it is loaded).

Transforms. Every new unit is a copy of an existing one on its input side, so it computes real
activations with the original's statistics, and has a zero output projection, so it adds exactly
nothing to the residual stream:

* **MLP neurons.** `intermediate_size` I -> I'; neuron j' >= I copies neuron j' mod I (its
  `gate_proj` and `up_proj` rows); its `down_proj` column is zero.
* **Attention heads with their KV heads.** KV heads K -> K' (any K' >= K), query heads =
  K' * group, group size and head_dim kept. New KV head k' copies KV head k' mod K (k/v rows and
  biases); query head k'*g + r copies query head (k' mod K)*g + r, so it attends over a copy of
  its source's keys and values; its `o_proj` input columns are zero. The KV cache grows with K'
  as a bigger model's would. q/k norms act per head_dim and RoPE on head_dim, so both are
  unchanged; head_dim is written explicitly (hidden // heads would no longer give it).

Why zero output projections rather than splitting them among the copies (w/c each): adding exact
zeros changes a sum only through the GEMM kernel's blocking, a few ulps that do not grow with the
size, while a 1/c split rounds every copy and its error grows with c. Measured against the demo
target (whose residual stream has ~140-magnitude channels), max |diff| of logits / context
features: zeros 5.7e-6 / 3.8e-5 at 100M (0.0 / 0.0 with MLP neurons alone, and on the golden
tiny target); 1/c split 7.6e-6 / 1.5e-4 at 100M. Dense GEMM kernels (PyTorch, ONNX Runtime,
TensorRT without an explicit 2:4-sparsity build over fully compliant weights) never look at weight
values, so the zero blocks cost what dense ones do.

KV heads are added until the KV cache per token per parameter is Qwen3-0.6B's (`KV_PER_PARAM`),
so attention's share of a step's memory traffic matches a real model's at any context length;
the MLP takes the rest of the budget (at hidden 256 a head is cheap in weights but not in cache,
so a weight-share rule would give a KV cache 5-15x too large).

Kept as they are: hidden size and vocab (the drafter's context features have the target's hidden
size and it shares the target's embeddings and LM head), every RMSNorm (hidden-size weights),
embeddings and LM head (tied or not), RoPE, and the layer count. Extra layers with zero o_proj
and down_proj would also preserve the function, and appended after the last layer they would
keep every context-feature id valid and non-final; but a drafter records its target's depth
(`num_target_layers`, checked by `check_drafter_fits_target`), so a deeper stand-in would refuse
the original drafter. Widening alone reaches any size (1.5B for a GPU included).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .checkpoint import INDEX_FILE, read_tensors
from .config import TargetConfig, read_config_json

STANDIN_KEY = "dspark_standin"
# KV-cache elements per token per parameter of Qwen3-0.6B (28 layers x 2 x 8 KV heads x 128 / 0.6B):
# attention's memory traffic then keeps the weight traffic's proportion at any context length.
KV_PER_PARAM = 28 * 2 * 8 * 128 / 0.6e9
SHARD_BYTES = 2 * 2**30  # safetensors shards, so a 1.5B stand-in is not one 6 GB file
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                "merges.txt", "generation_config.json")
_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


class InflateError(ValueError):
    """A bad size request or a source checkpoint the inflation cannot transform."""


def parse_params(text: str, source_params: int | None = None) -> int:
    """'100M', '1.5B', '250k', '123456', or '4x' (times `source_params`) -> a parameter count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMbBgGtTxX]?)\s*", text)
    if not match:
        raise InflateError(f"--params {text!r} is not a size (examples: 100M, 1.5B, 250k, 4x)")
    value, suffix = float(match.group(1)), match.group(2).lower()
    if suffix == "x":
        if source_params is None:
            raise InflateError(f"--params {text!r}: a multiple needs the source's parameter count")
        value *= source_params
    else:
        value *= _SUFFIXES.get(suffix, 1)
    if value < 1:
        raise InflateError(f"--params {text!r} must be a positive size")
    return math.ceil(value)


def format_params(params: int) -> str:
    """100000000 -> '100M', 1500000000 -> '1.5B': short names for folders and logs."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if params >= scale:
            return f"{params / scale:.4g}{unit}"
    return str(params)


def _attention_params(config: TargetConfig, kv_heads: int, heads: int) -> int:
    hidden, hd = config.hidden_size, config.head_dim
    weights = hidden * hd * (2 * heads + 2 * kv_heads)  # q, o + k, v
    bias = (heads + 2 * kv_heads) * hd + hidden if config.attention_bias else 0
    return weights + bias + (2 * hd if config.qk_norm else 0)


def _layer_params(config: TargetConfig, kv_heads: int, heads: int, intermediate: int) -> int:
    return 2 * config.hidden_size + _attention_params(config, kv_heads, heads) + 3 * config.hidden_size * intermediate


def _fixed_params(config: TargetConfig) -> int:
    """Embeddings, LM head (unless tied) and the final norm: what inflation does not touch."""
    heads = 1 if config.tie_word_embeddings else 2
    return heads * config.vocab_size * config.hidden_size + config.hidden_size


def count_params(config: TargetConfig) -> int:
    """Parameters of a target with this config (a tied LM head counted once)."""
    layer = _layer_params(config, config.num_key_value_heads, config.num_attention_heads, config.intermediate_size)
    return _fixed_params(config) + config.num_hidden_layers * layer


@dataclass(frozen=True)
class InflationPlan:
    """The stand-in's shape: what `inflate_tensors` builds from the source."""

    source_params: int
    requested_params: int
    num_key_value_heads: int
    num_attention_heads: int
    intermediate_size: int
    params: int

    def transforms(self, source: TargetConfig) -> list[str]:
        """Human-readable record of the transforms, for config.json and the README."""
        done = []
        if self.num_key_value_heads != source.num_key_value_heads:
            done.append(
                f"attention heads replicated {source.num_attention_heads} -> {self.num_attention_heads} "
                f"(kv heads {source.num_key_value_heads} -> {self.num_key_value_heads}, group size and "
                f"head_dim {source.head_dim} kept); new heads copy q/k/v rows of heads j mod n, their o_proj input "
                "columns are zero"
            )
        if self.intermediate_size != source.intermediate_size:
            done.append(
                f"MLP neurons replicated {source.intermediate_size} -> {self.intermediate_size}; "
                "new neurons copy gate/up rows of neurons j mod n, their down_proj columns are zero"
            )
        return done


def plan_inflation(config: TargetConfig, params: int, kv_per_param: float = KV_PER_PARAM) -> InflationPlan:
    """The smallest widening (KV heads, then MLP neurons) with >= `params` parameters.

    KV heads are added (in whole groups) until the KV cache per token is `kv_per_param` x params,
    as in a real model of that size; the MLP takes the rest. Neither shrinks below the source.
    """
    source = count_params(config)
    if params <= source:
        raise InflateError(
            f"--params {params:,} is not more than the target's {source:,} parameters: nothing to inflate"
        )
    if not 0.0 <= kv_per_param < 1.0:
        raise InflateError(f"kv_per_param must lie in [0, 1), got {kv_per_param}")
    budget = math.ceil((params - _fixed_params(config)) / config.num_hidden_layers)  # per layer
    group = config.num_attention_heads // config.num_key_value_heads
    kv_per_token_per_head = config.num_hidden_layers * 2 * config.head_dim
    kv_heads = max(config.num_key_value_heads, round(kv_per_param * params / kv_per_token_per_head))
    heads = kv_heads * group
    if _layer_params(config, kv_heads, heads, config.intermediate_size) > budget:  # attention alone overshoots
        kv_heads = config.num_key_value_heads
        heads = config.num_attention_heads
    rest = budget - _layer_params(config, kv_heads, heads, 0)
    intermediate = max(config.intermediate_size, math.ceil(rest / (3 * config.hidden_size)))
    total = _fixed_params(config) + config.num_hidden_layers * _layer_params(config, kv_heads, heads, intermediate)
    return InflationPlan(source, params, kv_heads, heads, intermediate, total)


def _copies(new: int, old: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit j' of `new` copies unit j' mod `old`: (source index per new unit, whether it is the
    original, i.e. keeps its output projection)."""
    index = torch.arange(new)
    return index % old, index < old


def inflate_layer(
    tensors: dict[str, torch.Tensor], config: TargetConfig, plan: InflationPlan
) -> dict[str, torch.Tensor]:
    """One decoder layer's tensors (names relative to the layer, e.g. 'self_attn.q_proj.weight')
    widened to the plan; tensors the transforms do not touch pass through."""
    hd, group = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    kv_index, kv_keep = _copies(plan.num_key_value_heads, config.num_key_value_heads)
    head_index = (kv_index[:, None] * group + torch.arange(group)).reshape(-1)  # [heads'] source head
    head_keep = kv_keep.repeat_interleave(group)
    mlp_index, mlp_keep = _copies(plan.intermediate_size, config.intermediate_size)

    def rows(t: torch.Tensor, index: torch.Tensor, unit: int) -> torch.Tensor:
        # dim 0 grouped in units of `unit` rows (a head's head_dim rows, or 1 neuron)
        return t.reshape(-1, unit, *t.shape[1:]).index_select(0, index).reshape(-1, *t.shape[1:])

    def columns(t: torch.Tensor, index: torch.Tensor, keep: torch.Tensor, unit: int) -> torch.Tensor:
        # dim 1 in units of `unit` columns; copies' columns are zero
        out = t.reshape(t.shape[0], -1, unit).index_select(1, index) * keep.to(t.dtype)[None, :, None]
        return out.reshape(t.shape[0], -1)

    out = {}
    for name, t in tensors.items():
        module, _, kind = name.rpartition(".")
        if module == "self_attn.q_proj":
            out[name] = rows(t, head_index, hd)
        elif module in ("self_attn.k_proj", "self_attn.v_proj"):
            out[name] = rows(t, kv_index, hd)
        elif module == "self_attn.o_proj" and kind == "weight":
            out[name] = columns(t, head_index, head_keep, hd)
        elif module in ("mlp.gate_proj", "mlp.up_proj"):
            out[name] = rows(t, mlp_index, 1)
        elif module == "mlp.down_proj":
            out[name] = columns(t, mlp_index, mlp_keep, 1)
        else:  # norms (hidden / head_dim sized), o_proj bias (hidden sized)
            out[name] = t
    return out


_LAYER = re.compile(r"^((?:model\.)?layers\.(\d+)\.)(.+)$")


def inflate_tensors(
    tensors: dict[str, torch.Tensor], config: TargetConfig, plan: InflationPlan
) -> Iterator[dict[str, torch.Tensor]]:
    """The stand-in's tensors, one group at a time (the untouched tensors, then layer by layer),
    so a 1.5B stand-in never has to sit in memory whole. Names keep the source's spelling."""
    layers: dict[int, dict[str, tuple[str, torch.Tensor]]] = {}
    rest = {}
    for name, t in tensors.items():
        match = _LAYER.match(name)
        if match:
            layers.setdefault(int(match.group(2)), {})[match.group(3)] = (match.group(1), t)
        else:
            rest[name] = t
    yield rest
    for i in sorted(layers):
        prefix = next(iter(layers[i].values()))[0]
        widened = inflate_layer({k: t for k, (_, t) in layers[i].items()}, config, plan)
        yield {prefix + k: t for k, t in widened.items()}


def read_standin(folder: str | Path) -> dict[str, Any] | None:
    """The `dspark_standin` section of a checkpoint's config.json (None for a real model)."""
    section = read_config_json(folder).get(STANDIN_KEY)
    return section if isinstance(section, dict) else None


def _previous_standin(folder: Path) -> dict[str, Any] | None:
    """`read_standin`, or None where the folder holds no readable config.json."""
    try:
        return read_standin(folder)
    except ValueError:
        return None


def source_key(folder: str | Path) -> str:
    """Digest of the source's file names, sizes and mtimes: whether a stand-in is still current
    costs a few stat calls, not a read of the weights."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).resolve().iterdir()):
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def is_current(out_dir: str | Path, target_dir: str | Path, params: int, kv_per_param: float) -> bool:
    """`out_dir` already holds the stand-in this request would write (same source files, size, split)."""
    out_dir = Path(out_dir)
    if not (out_dir / "config.json").is_file():
        return False
    section = _previous_standin(out_dir) or {}
    wanted = {"source": str(Path(target_dir).resolve()), "source_key": source_key(target_dir),
              "requested_params": params, "kv_per_param": kv_per_param}
    return all(section.get(k) == v for k, v in wanted.items())


def standin_label(folder: str | Path) -> str | None:
    """One line to print wherever a stand-in is loaded, or None for a real model."""
    section = read_standin(folder)
    if section is None:
        return None
    return (f"COST STAND-IN ({format_params(int(section.get('params', 0)))} parameters, inflated from "
            f"{section.get('source')}): its outputs are the source's; only its cost is that of its size")


def _readme(section: dict[str, Any]) -> str:
    transforms = "\n".join(f"- {t}" for t in section["transforms"])
    return f"""# COST STAND-IN — not a new model

This folder is `{section['source']}` ({section['source_params']:,} parameters) inflated to
{section['params']:,} parameters by function-preserving transforms (`dspark train standin`,
`dspark.models.inflate`). Its logits and context features equal the source's up to float rounding,
so a drafter trained for the source keeps its acceptance; only the cost of a step is that of a
{format_params(section['params'])}-parameter model. Use it to measure speed, never quality.

Transforms:
{transforms}

config.json carries the same record under `"{STANDIN_KEY}"`.
"""


def _write_shards(
    groups: Iterator[dict[str, torch.Tensor]], folder: Path, progress: Callable[[], None]
) -> None:
    """Save tensor groups as safetensors shards of <= SHARD_BYTES (one `model.safetensors` when it
    all fits), with the Hugging Face index for several."""
    written: list[Path] = []
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, int] = {}
    size = total = 0

    def flush() -> None:
        path = folder / f"shard-{len(written):05d}.tmp"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(path), metadata={"format": "pt"})
        path.chmod(0o644)  # safetensors writes 0600; a checkpoint is for anyone to read
        written.append(path)

    for group in groups:
        for name, t in group.items():
            nbytes = t.numel() * t.element_size()
            if shard and size + nbytes > SHARD_BYTES:
                flush()
                shard, size = {}, 0
            shard[name] = t
            weight_map[name] = len(written)
            size, total = size + nbytes, total + nbytes
        progress()
    flush()
    if len(written) == 1:
        written[0].rename(folder / "model.safetensors")
        return
    names = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    for path, name in zip(written, names, strict=True):
        path.rename(folder / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in sorted(weight_map.items())}}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def inflate_checkpoint(
    target_dir: str | Path,
    out_dir: str | Path,
    params: int,
    *,
    kv_per_param: float = KV_PER_PARAM,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write the stand-in of `target_dir` with >= `params` parameters to `out_dir` (a Hugging Face
    folder: config.json with the `dspark_standin` record, safetensors, tokenizer files, README.md);
    returns the record. `out_dir` is replaced only if it is a previous stand-in."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    config = TargetConfig.from_folder(target_dir)
    data = read_config_json(target_dir)
    if STANDIN_KEY in data:
        raise InflateError(f"{target_dir} is already a cost stand-in; inflate the original instead")
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and _previous_standin(out_dir) is None)):
        raise InflateError(f"--out {out_dir} exists and is not a previous stand-in; refusing to overwrite it")
    plan = plan_inflation(config, params, kv_per_param)
    section = {
        "note": "COST STAND-IN: outputs equal the source's; only its cost is that of its size",
        "source": str(target_dir.resolve()),
        "source_params": plan.source_params,
        "source_key": source_key(target_dir),
        "requested_params": plan.requested_params,
        "kv_per_param": kv_per_param,
        "params": plan.params,
        "transforms": plan.transforms(config),
        "unchanged": "hidden size, vocab, head_dim, layer count, norms, embeddings, LM head, RoPE",
    }
    data.update(num_attention_heads=plan.num_attention_heads, num_key_value_heads=plan.num_key_value_heads,
                intermediate_size=plan.intermediate_size, head_dim=config.head_dim)
    data[STANDIN_KEY] = section

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tensors = read_tensors(target_dir)
    steps = iter(range(1 + config.num_hidden_layers))

    def step() -> None:
        done = next(steps)
        if progress is not None:
            progress("embeddings/head" if done == 0 else f"layer {done - 1}")

    _write_shards(inflate_tensors(tensors, config, plan), partial, step)
    (partial / "config.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    (partial / "README.md").write_text(_readme(section), encoding="utf-8")
    for name in COPIED_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, partial / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return section
