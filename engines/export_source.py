"""Reading a dspark-export directory for an engine build: every user error gets one clear line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dspark.export.manifest import MANIFEST, read_manifest, sha256


class BuildError(ValueError):
    """A dspark-build-engine input or option that cannot be used as given (exit code 2)."""


def load_export(export_dir: str | Path, *, verify_files: bool = True) -> dict[str, Any]:
    """export.json of `export_dir`, with every graph file present and matching its sha256."""
    root = Path(export_dir)
    if not root.is_dir():
        raise BuildError(f"export directory {root} does not exist (run dspark-export first)")
    try:
        manifest = read_manifest(root)
    except FileNotFoundError as exc:
        raise BuildError(str(exc)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BuildError(f"{root / MANIFEST} is corrupt: not valid JSON ({exc}); re-run dspark-export") from None
    except ValueError as exc:
        raise BuildError(f"{exc}; re-run dspark-export") from None
    for key in ("dtype", "target", "drafter", "graphs", "lm_head_in_backbone"):
        if key not in manifest:
            raise BuildError(f"{root / MANIFEST} is corrupt: no '{key}' field; re-run dspark-export")
    for section, key in (("target", "vocab_size"), ("target", "max_position_embeddings"),
                         ("drafter", "block_size")):
        if not isinstance(manifest[section], dict) or not isinstance(manifest[section].get(key), int):
            raise BuildError(f"{root / MANIFEST} is corrupt: no integer {section}.{key}; re-run dspark-export")
    graphs = manifest["graphs"]
    if not isinstance(graphs, dict) or "target" not in graphs or "drafter_backbone" not in graphs:
        raise BuildError(f"{root / MANIFEST} is corrupt: 'graphs' lacks target/drafter_backbone; re-run dspark-export")
    if verify_files:
        for name, entry in graphs.items():
            for f in entry.get("files", []):
                path = root / f["path"]
                if not path.is_file():
                    raise BuildError(f"graph '{name}': {path} is missing; re-run dspark-export")
                if sha256(path) != f["sha256"]:
                    raise BuildError(f"graph '{name}': {path} does not match the sha256 in export.json "
                                     f"(modified or truncated); re-run dspark-export")
    return manifest
