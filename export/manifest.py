"""`export.json`: what the runtime needs to drive the exported graphs, next to them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from dspark.models import DrafterConfig, TargetConfig

MANIFEST = "export.json"
FORMAT_VERSION = 1


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
        },
        "drafter": {
            "block_size": drafter.block_size,
            "mask_token_id": drafter.mask_token_id,
            "target_layer_ids": list(drafter.target_layer_ids),
            "num_layers": drafter.num_hidden_layers,
            "num_kv_heads": drafter.num_key_value_heads,
            "head_dim": drafter.head_dim,
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


def read_manifest(export_dir: str | Path) -> dict[str, Any]:
    path = Path(export_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {export_dir} is not a dspark-export output")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {manifest.get('format_version')} is not {FORMAT_VERSION}")
    return manifest
