"""Run ONNX nodes of the `dspark` domain in ONNX Runtime.

Route: onnxruntime-extensions Python custom ops. Its wheel loads into the installed onnxruntime
and executes @onnx_op functions (here: the numpy references), but it registers every Python op in
its own fixed domain, `ai.onnx.contrib`. Exported graphs keep the `dspark` domain (that is the
contract, and what TensorRT's parser sees); `prepare_for_ort` returns a copy whose `dspark` nodes
are moved to that domain, and `make_session` does both steps. See plugins/README.md for why a
native C++ custom-op library is not built here.

An exception raised inside a Python op would cross into ONNX Runtime and abort the process
(std::terminate), so the ops catch it, record the message and return sentinel outputs
(position_ids -1, accept_length 0, bonus_token -1); `DsparkSession.run` re-raises the recorded
message as PluginInputError. Sessions built by hand from `prepare_for_ort` only get the sentinels.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
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

_errors: list[str] = []
_errors_lock = threading.Lock()


class PluginInputError(ValueError):
    """A dspark op rejected its inputs during an ONNX Runtime run."""


def make_node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str, **attrs: int) -> onnx.NodeProto:
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


def _shape2(x: np.ndarray) -> tuple[int, int]:
    return (x.shape[0], x.shape[1]) if x.ndim == 2 else (0, 0)


def _mask_sentinel(parents: np.ndarray, *_: np.ndarray) -> tuple[np.ndarray, ...]:
    batch, n = _shape2(parents)
    return (
        np.zeros((batch, 1, n, n), dtype=bool),
        np.full((batch, n), -1, dtype=np.int64),
        np.zeros((batch, n, -(-n // 32)), dtype=np.int32),
    )


def _accept_sentinel(parents: np.ndarray, *_: np.ndarray, max_depth: int) -> tuple[np.ndarray, ...]:
    batch, width = _shape2(parents)[0], max(int(max_depth), 0) + 1
    path = np.full((batch, width), -1, dtype=np.int64)
    return path, np.zeros(batch, dtype=np.int64), np.full(batch, -1, dtype=np.int64), path.copy()


def _guarded(op_type: str, compute: Callable, sentinel: Callable) -> Callable:
    def run(*inputs: np.ndarray, **attrs: int):
        try:
            return compute(*inputs, **attrs)
        except Exception as err:  # raising into ONNX Runtime would abort the process
            with _errors_lock:
                _errors.append(f"{op_type}: {err}")
            return sentinel(*inputs, **attrs)

    return run


def _accept_outputs(result: accept_ref.TreeAcceptResult) -> tuple[np.ndarray, ...]:
    return result.accepted_path, result.accept_length, result.bonus_token, result.kv_keep


def _greedy(parents, draft_tokens, past_lengths, target_tokens, max_depth):
    return _accept_outputs(accept_ref.tree_accept_greedy(parents, draft_tokens, past_lengths, target_tokens, max_depth))


def _sampling(parents, draft_tokens, past_lengths, target_probs, draft_probs, uniforms, max_depth):
    result = accept_ref.tree_accept_sampling(
        parents, draft_tokens, past_lengths, target_probs, draft_probs, uniforms, max_depth
    )
    return _accept_outputs(result)


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
    mask_outputs = [PyCustomOpDef.dt_bool, i64, PyCustomOpDef.dt_int32]
    onnx_op(op_type="TreeAttentionMask", inputs=[i64, i64], outputs=mask_outputs)(
        _guarded("TreeAttentionMask", mask_ref.tree_attention_mask, _mask_sentinel)
    )
    onnx_op(op_type="TreeAccept", inputs=[i64] * 4, outputs=[i64] * 4, attrs={"max_depth": i64})(
        _guarded("TreeAccept", _greedy, _accept_sentinel)
    )
    sampling_inputs = [i64, i64, i64, f32, f32, f32]
    onnx_op(op_type="TreeAcceptSampling", inputs=sampling_inputs, outputs=[i64] * 4, attrs={"max_depth": i64})(
        _guarded("TreeAcceptSampling", _sampling, _accept_sentinel)
    )
    return get_library_path()


def session_options(options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """Session options with the dspark ops registered (a new object unless one is passed in)."""
    options = options or ort.SessionOptions()
    options.register_custom_ops_library(register_ops())
    return options


class DsparkSession:
    """An ONNX Runtime session over a model with dspark nodes; run() raises what the ops rejected."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session

    def run(self, output_names: Sequence[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with _errors_lock:
            _errors.clear()
        outputs = self.session.run(output_names, feeds)
        with _errors_lock:
            errors, _errors[:] = list(_errors), []
        if errors:
            raise PluginInputError("; ".join(errors))
        return outputs


def make_session(model: onnx.ModelProto, options: ort.SessionOptions | None = None) -> DsparkSession:
    """CPU session for a model that may contain dspark nodes."""
    session = ort.InferenceSession(
        prepare_for_ort(model).SerializeToString(),
        session_options(options),
        providers=["CPUExecutionProvider"],
    )
    return DsparkSession(session)
