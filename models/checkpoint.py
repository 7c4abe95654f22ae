"""Reading safetensors checkpoints (single file or sharded index) into modules, key by key."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, from its index when it is sharded."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors weights (PyTorch .bin files are not supported)")
    return files


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, by parameter name."""
    tensors: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(folder):
        try:
            shard = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
        duplicated = tensors.keys() & shard.keys()
        if duplicated:
            raise CheckpointError(f"{path} repeats tensors of another shard: {sorted(duplicated)[:5]}")
        tensors.update(shard)
    return tensors


def load_weights(
    module: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    *,
    source: str,
    optional: Iterable[str] = (),
    ignore_prefixes: Iterable[str] = (),
) -> None:
    """Copy `tensors` into `module`, checking every name and shape before touching the module.

    `optional` parameters may be absent (they keep their current value); tensors under
    `ignore_prefixes` are skipped. Anything else missing, unexpected or misshapen is an error
    that lists every problem at once.
    """
    expected = dict(module.state_dict())
    optional = set(optional)
    ignore = tuple(ignore_prefixes)
    present = {k: v for k, v in tensors.items() if not k.startswith(ignore)} if ignore else tensors
    missing = sorted(k for k in expected.keys() - present.keys() if k not in optional)
    unexpected = sorted(present.keys() - expected.keys())
    misshapen = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in present.items()
        if k in expected and tuple(v.shape) != tuple(expected[k].shape)
    ]
    problems = []
    if missing:
        problems.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if misshapen:
        problems.append(f"wrong shapes {misshapen[:8]}")
    if problems:
        raise CheckpointError(f"{source} does not match its config: " + "; ".join(problems))
    with torch.no_grad():
        for name, value in present.items():
            expected[name].copy_(value)
