"""dspark.plugins: the TreeAttentionMask and TreeAccept custom operators.

Each operator lives in plugins/<op>/ with its contract (README.md, schema.yaml), the numpy
reference, the CUDA kernel behind a C launcher and the TensorRT plugin. This module exposes the
array-facing API; `dspark.plugins.ort` runs ONNX nodes of the `dspark` domain in ONNX Runtime.
"""

from .api import (
    TreeMask,
    child_draft_probs,
    compose_full_mask,
    tree_accept_greedy,
    tree_accept_sampling,
    tree_attention_mask,
)
from .tree_accept.reference import TreeAcceptResult

__all__ = [
    "TreeAcceptResult",
    "TreeMask",
    "child_draft_probs",
    "compose_full_mask",
    "tree_accept_greedy",
    "tree_accept_sampling",
    "tree_attention_mask",
]
