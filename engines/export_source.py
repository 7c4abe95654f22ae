"""Reading a dspark-export directory for an engine build; bad files raise ArtifactError (one line)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.export.manifest import read_manifest


class BuildError(ValueError):
    """A dspark-build-engine input or option that cannot be used as given (exit code 2)."""


def load_export(export_dir: str | Path, *, verify_files: bool = True) -> dict[str, Any]:
    """export.json of `export_dir`, schema-checked, with every graph file matching its sha256."""
    return read_manifest(export_dir, verify="sha256" if verify_files else "none")
