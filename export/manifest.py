"""`export.json`: what the runtime needs to drive the exported graphs, next to them.

Written by `dspark-export` (and, derived, by `dspark-build-engine` for ORT engines); read by the
runtime and the builders through `read_manifest`, which checks the schema and raises ArtifactError
naming the file and the field. `graph_specs` turns its graph entries into the contract's GraphSpecs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspark.models import DrafterConfig, TargetConfig
from dspark.models.config import DecoderConfig
from dspark.models.inflate import read_standin

from .artifacts import ArtifactError, check_sha256, check_size, read_json_object, sha256
from .contract import DTYPES, GraphSpec, TensorSpec
from .engine_dir import ENGINE_JSON, REBUILD

MANIFEST = "export.json"
FORMAT_VERSION = 1
REEXPORT = "re-run dspark-export"


def file_entries(paths: list[Path], root: Path) -> list[dict[str, Any]]:
    return [
        {"path": p.relative_to(root).as_posix(), "bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in paths
    ]


def eos_token_ids(config: TargetConfig, target_dir: Path) -> list[int]:
    """config.json's eos ids plus generation_config.json's (chat models often list more there)."""
    ids = list(config.eos_token_ids)
    generation = target_dir / "generation_config.json"
    if generation.is_file():
        extra = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
        for i in [extra] if isinstance(extra, int) else (extra or []):
            if i not in ids:
                ids.append(int(i))
    return ids


def attention_layers(config: DecoderConfig) -> dict[str, Any]:
    """Per-layer attention layouts where layers differ (Gemma-4), with how sliding-window layers keep
    their keys/values (see contract.py); nothing for uniform models."""
    if config.uniform_attention:
        return {}
    windowed = any(lay.sliding_window for lay in config.layouts)
    return {"attention_layers": [lay.to_json() for lay in config.layouts],
            **({"sliding_window_kv": "full-length"} if windowed else {})}


def model_section(target: TargetConfig, drafter: DrafterConfig, target_dir: Path) -> dict[str, Any]:
    return {
        "target": {
            "model_type": target.model_type,
            "vocab_size": target.vocab_size,
            "hidden_size": target.hidden_size,
            "num_layers": target.num_hidden_layers,
            "num_kv_heads": target.num_key_value_heads,
            "head_dim": target.head_dim,
            "max_position_embeddings": target.max_position_embeddings,
            "eos_token_ids": eos_token_ids(target, target_dir),
            "pad_token_id": target.pad_token_id,
            "bos_token_id": target.bos_token_id,
            "context_layer_ids": list(drafter.target_layer_ids),
            "context_feature_size": drafter.context_feature_size,
            **attention_layers(target),
            # a cost stand-in (models/inflate.py) says so wherever its export is read
            "standin": read_standin(target_dir),
        },
        "drafter": {
            "block_size": drafter.block_size,
            "mask_token_id": drafter.mask_token_id,
            "target_layer_ids": list(drafter.target_layer_ids),
            "num_layers": drafter.num_hidden_layers,
            "num_kv_heads": drafter.num_key_value_heads,
            "head_dim": drafter.head_dim,
            **attention_layers(drafter),
            "markov_rank": drafter.markov_rank,
            "markov_head_type": drafter.markov_head_type if drafter.has_markov_head else None,
            "head_state": "zeros [batch, markov_rank] before slot 0"
            if drafter.has_markov_head and drafter.markov_head_type == "rnn"
            else None,
            "enable_confidence_head": drafter.enable_confidence_head,
            "confidence_head_with_markov": drafter.confidence_head_with_markov,
            "confidence_output": "pre-sigmoid logit" if drafter.enable_confidence_head else None,
        },
    }


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> Path:
    path = out_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return path


def remedy(export_dir: Path) -> str:
    """What to do about a bad file in `export_dir`: rebuild it if it is an engine dir, else re-export."""
    return REBUILD if (export_dir / ENGINE_JSON).is_file() else REEXPORT


def read_manifest(export_dir: str | Path, *, verify: str = "size", of_engine: bool = False) -> dict[str, Any]:
    """export.json of `export_dir`, schema-checked. verify: "size" (each graph file present with its
    recorded size: cheap), "sha256" (also hashed) or "none". An export.json that dspark-build-engine
    derived for an engine is refused without its engine.json (which holds the buckets, SPS table and
    temperatures), unless `of_engine`: the caller reads it for that engine (the builder, before
    engine.json is written)."""
    root = Path(export_dir)
    path = root / MANIFEST
    if not root.is_dir():
        raise ArtifactError(root, "is not a directory", "give a dspark-export or dspark-build-engine output")
    fix = remedy(root)
    manifest = read_json_object(path, fix)
    _validate(manifest, path, fix)
    if "derived_from" in manifest and not of_engine and not (root / ENGINE_JSON).is_file():
        raise ArtifactError(root / ENGINE_JSON, f"is missing, but {MANIFEST} beside it was derived for an engine "
                            "by dspark-build-engine", REBUILD)
    if verify != "none":
        for entry in manifest["graphs"].values():
            for f in entry["files"]:
                if verify == "sha256":
                    check_sha256(root / f["path"], f["sha256"], fix)
                else:
                    check_size(root / f["path"], f["bytes"], fix)
    return manifest


def graph_specs(manifest: dict[str, Any]) -> dict[str, GraphSpec]:
    """{graph name: GraphSpec} from a checked manifest's graph entries."""
    def tensors(items: list[dict]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t["name"], t["dtype"], tuple(t["dims"])) for t in items)

    return {name: GraphSpec(name, tensors(e["inputs"]), tensors(e["outputs"]))
            for name, e in manifest["graphs"].items()}


_INT_FIELDS = {
    "target": ("vocab_size", "hidden_size", "num_layers", "num_kv_heads", "head_dim", "max_position_embeddings",
               "context_feature_size"),
    "drafter": ("block_size", "mask_token_id", "num_layers", "num_kv_heads", "head_dim", "markov_rank"),
}
_REQUIRED_GRAPHS = ("target", "drafter_backbone")


def _validate(manifest: dict[str, Any], path: Path, fix: str) -> None:
    def fail(problem: str) -> None:
        raise ArtifactError(path, problem, fix)

    if manifest.get("format_version") != FORMAT_VERSION:
        fail(f"format_version {manifest.get('format_version')!r} is not {FORMAT_VERSION}")
    if manifest.get("dtype") not in DTYPES:
        fail(f"dtype {manifest.get('dtype')!r} is not one of {DTYPES}")
    if not isinstance(manifest.get("lm_head_in_backbone"), bool):
        fail("lm_head_in_backbone must be true or false")
    for section, keys in _INT_FIELDS.items():
        values = manifest.get(section)
        if not isinstance(values, dict):
            fail(f"no '{section}' object")
        for key in keys:
            if isinstance(values.get(key), bool) or not isinstance(values.get(key), int) or values[key] < 0:
                fail(f"{section}.{key} must be a non-negative integer, got {values.get(key)!r}")
    for section in _INT_FIELDS:
        layers = manifest[section].get("attention_layers")
        if layers is not None and (
            not isinstance(layers, list) or len(layers) != manifest[section]["num_layers"]
            or not all(isinstance(lay, dict) and isinstance(lay.get("num_kv_heads"), int)
                       and isinstance(lay.get("head_dim"), int) for lay in layers)):
            fail(f"{section}.attention_layers must list num_layers objects with integer num_kv_heads and head_dim")
    ids = manifest["target"].get("eos_token_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        fail("target.eos_token_ids must be a list of integers")
    drafter = manifest["drafter"]
    if drafter.get("markov_head_type") not in (None, "vanilla", "gated", "rnn"):
        fail(f"drafter.markov_head_type {drafter.get('markov_head_type')!r} is unknown")
    if not isinstance(drafter.get("enable_confidence_head"), bool):
        fail("drafter.enable_confidence_head must be true or false")
    graphs = manifest.get("graphs")
    if not isinstance(graphs, dict) or any(g not in graphs for g in _REQUIRED_GRAPHS):
        fail(f"'graphs' must hold at least {list(_REQUIRED_GRAPHS)}")
    for name, entry in graphs.items():
        _validate_graph(name, entry, fail)


def _validate_graph(name: str, entry: Any, fail) -> None:
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        fail(f"graphs.{name} needs a 'file'")
    for side in ("inputs", "outputs"):
        items = entry.get(side)
        if not isinstance(items, list) or not items or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
            and isinstance(t.get("dims"), list) and all(isinstance(d, int | str) for d in t["dims"])
            for t in items
        ):
            fail(f"graphs.{name}.{side} must list tensors with name, dtype and dims")
    files = entry.get("files")
    if not isinstance(files, list) or not files or not all(
        isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("bytes"), int)
        and isinstance(f.get("sha256"), str) for f in files
    ):
        fail(f"graphs.{name}.files must list path, bytes and sha256 of each file")
