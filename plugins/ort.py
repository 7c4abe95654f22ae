"""Run ONNX nodes of the `dspark` domain in ONNX Runtime.

Route: onnxruntime-extensions Python custom ops. Its wheel loads into the installed onnxruntime
and executes @onnx_op functions (here: the numpy references), but it registers every Python op in
its own fixed domain, `ai.onnx.contrib`. Exported graphs keep the `dspark` domain (that is the
contract, and what TensorRT's parser sees); `prepare_for_ort` returns a copy whose `dspark` nodes
are moved to that domain, and `make_session` does both steps. See plugins/README.md for why a
native C++ custom-op library is not built here.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import cache

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from .tree_accept import reference as accept_ref
from .tree_attention_mask import reference as mask_ref

DOMAIN = "dspark"
OPSET_VERSION = 1
PLUGIN_NAMESPACE = "dspark"
ORT_PYOP_DOMAIN = "ai.onnx.contrib"
OP_TYPES = ("TreeAttentionMask", "TreeAccept", "TreeAcceptSampling")


def make_node(
    op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str, **attrs: int
) -> onnx.NodeProto:
    """A `dspark` node; `plugin_namespace` tells TensorRT's ONNX parser which plugin namespace to search."""
    if op_type not in OP_TYPES:
        raise ValueError(f"unknown dspark op type {op_type!r}; expected one of {OP_TYPES}")
    return helper.make_node(
        op_type,
        list(inputs),
        list(outputs),
        name=name,
        domain=DOMAIN,
        plugin_namespace=PLUGIN_NAMESPACE,
        **attrs,
    )


def opset_import() -> onnx.OperatorSetIdProto:
    return helper.make_operatorsetid(DOMAIN, OPSET_VERSION)


def _retarget(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        if node.domain == DOMAIN:
            node.domain = ORT_PYOP_DOMAIN
        for attr in node.attribute:
            for sub in [attr.g, *attr.graphs]:
                _retarget(sub)


def prepare_for_ort(model: onnx.ModelProto) -> onnx.ModelProto:
    """Copy of `model` whose dspark nodes sit in onnxruntime-extensions' Python-op domain."""
    prepared = copy.deepcopy(model)
    _retarget(prepared.graph)
    imports = [op for op in prepared.opset_import if op.domain not in (DOMAIN, ORT_PYOP_DOMAIN)]
    del prepared.opset_import[:]
    prepared.opset_import.extend([*imports, helper.make_operatorsetid(ORT_PYOP_DOMAIN, OPSET_VERSION)])
    return prepared


@cache
def register_ops() -> str:
    """Register the Python implementations once per process; returns the extensions library path."""
    try:
        from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op
    except ImportError as err:
        raise ImportError(
            "running dspark plugin nodes in ONNX Runtime needs onnxruntime-extensions: "
            "pip install 'onnxruntime-extensions>=0.15'"
        ) from err
    i64, f32 = PyCustomOpDef.dt_int64, PyCustomOpDef.dt_float

    @onnx_op(
        op_type="TreeAttentionMask",
        inputs=[i64, i64],
        outputs=[PyCustomOpDef.dt_bool, i64, PyCustomOpDef.dt_int32],
    )
    def tree_attention_mask(parents, past_lengths):
        return mask_ref.tree_attention_mask(parents, past_lengths)

    def outputs(result: accept_ref.TreeAcceptResult) -> tuple[np.ndarray, ...]:
        return result.accepted_path, result.accept_length, result.bonus_token, result.kv_keep

    @onnx_op(op_type="TreeAccept", inputs=[i64] * 4, outputs=[i64] * 4, attrs={"max_depth": i64})
    def tree_accept(parents, draft_tokens, past_lengths, target_tokens, max_depth):
        return outputs(
            accept_ref.tree_accept_greedy(parents, draft_tokens, past_lengths, target_tokens, max_depth)
        )

    @onnx_op(
        op_type="TreeAcceptSampling",
        inputs=[i64, i64, i64, f32, f32, f32],
        outputs=[i64] * 4,
        attrs={"max_depth": i64},
    )
    def tree_accept_sampling(
        parents, draft_tokens, past_lengths, target_probs, draft_probs, uniforms, max_depth
    ):
        result = accept_ref.tree_accept_sampling(
            parents, draft_tokens, past_lengths, target_probs, draft_probs, uniforms, max_depth
        )
        return outputs(result)

    return get_library_path()


def session_options(options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """Session options with the dspark ops registered (a new object unless one is passed in)."""
    options = options or ort.SessionOptions()
    options.register_custom_ops_library(register_ops())
    return options


def make_session(model: onnx.ModelProto, options: ort.SessionOptions | None = None) -> ort.InferenceSession:
    """CPU InferenceSession for a model that may contain dspark nodes."""
    return ort.InferenceSession(
        prepare_for_ort(model).SerializeToString(),
        session_options(options),
        providers=["CPUExecutionProvider"],
    )
