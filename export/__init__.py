"""dspark.export: a target and its DSpark drafter -> ONNX graphs + export.json (see README.md)."""

from .contract import BACKBONE, HEAD_GREEDY, HEAD_STEP, TARGET, TARGET_STATIC, GraphSpec, TensorSpec
from .lower import ExportError
from .manifest import MANIFEST, read_manifest
from .pipeline import export_pair

__all__ = [
    "BACKBONE",
    "HEAD_GREEDY",
    "HEAD_STEP",
    "MANIFEST",
    "TARGET",
    "TARGET_STATIC",
    "ExportError",
    "GraphSpec",
    "TensorSpec",
    "export_pair",
    "read_manifest",
]
