"""Writing ONNX graphs node by node: what the fused flavours (`fused_target.py`, `fused_drafter.py`) share.

`GraphBuilder` collects nodes and initializers under unique names; `linear` packs several nn.Linear layers
into one MatMul, `head_norm` is a per-head RMSNorm, `save_graph` writes a graph (external data above a
size). The graphs hold com.microsoft ops, so onnx.checker cannot check them: loading them into ONNX
Runtime is the check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from . import contract as C
from .lower import EXTERNAL_SUFFIX, TWO_GB

MS_DOMAIN = "com.microsoft"
HEAD_DIM_MULTIPLE = 16  # GroupQueryAttention's CPU kernel: "head_size shall be a multiple of 16"
ELEM = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
    "bool": TensorProto.BOOL,
}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class GraphBuilder:
    """Nodes, initializers and unique names for one graph."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: set[str] = set()

    def weight(self, name: str, tensor: torch.Tensor) -> str:
        """A float initializer in the graph's dtype (bfloat16 goes through its raw bits)."""
        t = tensor.detach().to(TORCH_DTYPES[self.dtype]).contiguous()
        if self.dtype == "bfloat16":
            proto = helper.make_tensor(name, TensorProto.BFLOAT16, t.shape, t.view(torch.int16).numpy().tobytes(),
                                       raw=True)
        else:
            proto = numpy_helper.from_array(t.numpy(), name)
        return self._add(proto)

    def const(self, name: str, values: list[int], dtype=np.int64) -> str:
        return self._add(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))

    def _add(self, proto: onnx.TensorProto) -> str:
        assert proto.name not in self._names, proto.name
        self._names.add(proto.name)
        self.initializers.append(proto)
        return proto.name

    def op(self, op_type: str, inputs: list[str], name: str, outputs: int | list[str] = 1,
           domain: str = "", **attrs) -> list[str]:
        """Add one node named `name`; its outputs are `name/out{k}` unless given ("" = unused)."""
        if isinstance(outputs, int):
            outputs = [f"{name}/out{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs


def linear(b: GraphBuilder, x: str, weights: list[torch.Tensor], biases: list[torch.Tensor | None], name: str) -> str:
    """x @ concat(weights)^T (+ concat(biases)): several nn.Linear layers as one packed MatMul."""
    w = b.weight(f"{name}.weight", torch.cat(weights, dim=0).T)
    (y,) = b.op("MatMul", [x, w], f"{name}/MatMul")
    if biases[0] is not None:  # `attention_bias` configs give every projection a bias
        (y,) = b.op("Add", [y, b.weight(f"{name}.bias", torch.cat(biases))], f"{name}/Add")
    return y


def head_norm(b: GraphBuilder, x: str, head_shape: str, back: str, weight: torch.Tensor, name: str,
               attrs: dict) -> str:
    """Per-head RMSNorm: [B, T, heads*hd] -> [B, T*heads, hd] -> norm -> [B, T, heads*hd]."""
    (y,) = b.op("Reshape", [x, head_shape], f"{name}/Reshape_in")
    (y,) = b.op("SimplifiedLayerNormalization", [y, b.weight(f"{name}.weight", weight)], name, **attrs)
    (y,) = b.op("Reshape", [y, back], f"{name}/Reshape_out")
    return y


def value_info(t: C.TensorSpec) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(t.name, ELEM[t.dtype], list(t.dims))


def save_graph(model: onnx.ModelProto, out_dir: Path, *, external_data_threshold: int = TWO_GB) -> list[Path]:
    """Write `<graph name>.onnx` (weights to `<graph name>.onnx.data` above the threshold); returns
    the written files. The graph holds com.microsoft ops and the ORT-only SimplifiedLayerNormalization,
    so onnx.checker cannot check it: loading it into ONNX Runtime is the check (`check_loads`)."""
    path = Path(out_dir) / f"{model.graph.name}.onnx"
    weight_bytes = sum(len(t.raw_data) if t.HasField("raw_data") else numpy_helper.to_array(t).nbytes
                       for t in model.graph.initializer)
    if weight_bytes > external_data_threshold:
        data = path.with_name(path.name + EXTERNAL_SUFFIX)
        data.unlink(missing_ok=True)  # onnx appends to an existing data file
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=1024)
        return [path, data]
    onnx.save_model(model, str(path))
    return [path]
