"""Initializers in ONNX external data, one at a time: what lets the quantizer rewrite a real-size graph in
memory bounded by its largest weight rather than all of them (`quantize.quantize_graph`).

`WeightStream` reads a tensor's bytes from the source graph's data file when it is needed (`load`, into a copy
that is dropped afterwards), appends new tensors to the target graph's data file as soon as they are made
(`spill`), and at the end copies whatever still points at the source file into the target's (`finish`, in
chunks), so the target graph never refers to the source's files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from .export_source import BuildError

SPILL_BYTES = 1024  # smaller tensors stay in the graph file (onnx.save_model's size_threshold)
_ALIGN = 4096  # tensors start on page boundaries in the data file (as onnx and ORT's own writers do)
_CHUNK = 64 << 20  # bytes per read when copying a tensor between data files


def is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _entries(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _point(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """The tensor's bytes are `length` bytes at `offset` of `location` (its raw_data dropped)."""
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


class WeightStream:
    """The source graph's data files (beside `source_dir`) in, one data file `target` out."""

    def __init__(self, source_dir: Path, target: Path) -> None:
        self.source_dir, self.target = source_dir, target
        target.unlink(missing_ok=True)
        self._out = target.open("wb")
        self._spilled: set[str] = set()  # tensors already in the target's data file
        self._transposed: set[str] = set()  # tensors whose bytes are their source weight's, transposed on load

    def load(self, tensor: onnx.TensorProto) -> None:
        """Its bytes into `raw_data`, from the source's data file (nothing for an inline tensor). Load a copy
        held by a message of its own (a scratch graph), never the model's tensor: protobuf keeps a message
        tree's bytes in one arena until the whole tree is freed, so bytes read into the model stay."""
        if is_external(tensor):
            self._inline(tensor)

    def _inline(self, tensor: onnx.TensorProto) -> None:
        """The bytes into `raw_data` once (assigned twice, a message's arena would keep both)."""
        entries = _entries(tensor)
        with (self.source_dir / entries["location"]).open("rb") as source:
            source.seek(int(entries.get("offset", 0)))
            data = source.read(int(entries["length"]))
        if len(data) != int(entries["length"]):
            raise BuildError(f"{entries['location']} ends inside {tensor.name}: the export's weights are cut short")
        if tensor.name in self._transposed:  # the bytes are the source weight's [cols, rows]: transpose them
            rows, cols = tensor.dims
            unit = np.dtype(f"u{onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize}")
            data = np.frombuffer(data, unit).reshape(cols, rows).T.tobytes()
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = data

    def fold_transposes(self, graph: onnx.GraphProto) -> None:
        """`MatMul(x, Transpose(W))` -> `MatMul(x, Wᵀ)` where W is a 2-D weight in external data and the
        Transpose feeds MatMul weights only (a --stream-weights export traces over placeholder weights, so
        nothing folded them): ORT's quantizer rewrites MatMuls whose weight is an initializer, and Wᵀ is one
        whose bytes are read from W's, transposed, when loaded."""
        weights = {t.name: t for t in graph.initializer if is_external(t) and len(t.dims) == 2}
        readers: dict[str, list[tuple[str, int]]] = {}
        for node in graph.node:
            for slot, name in enumerate(node.input):
                readers.setdefault(name, []).append((node.op_type, slot))
        folded = []
        for node in graph.node:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), [1, 0])
            if (node.op_type != "Transpose" or perm != [1, 0] or node.input[0] not in weights
                    or any(reader != ("MatMul", 1) for reader in readers.get(node.output[0], [("", 0)]))):
                continue
            weight = weights[node.input[0]]
            tensor = graph.initializer.add()
            tensor.name, tensor.data_type = node.output[0], weight.data_type
            tensor.dims.extend(reversed(weight.dims))
            entries = _entries(weight)
            _point(tensor, entries["location"], int(entries.get("offset", 0)), int(entries["length"]))
            self._transposed.add(tensor.name)
            folded.append(node)
        for node in folded:
            graph.node.remove(node)

    def spill(self, tensor: onnx.TensorProto) -> None:
        """A tensor made here (its bytes in `raw_data`) goes to the target's data file now."""
        if is_external(tensor) or not tensor.HasField("raw_data") or len(tensor.raw_data) < SPILL_BYTES:
            return
        offset = self._pad()
        self._out.write(tensor.raw_data)
        _point(tensor, self.target.name, offset, len(tensor.raw_data))
        self._spilled.add(tensor.name)

    def finish(self, graph: onnx.GraphProto) -> int:
        """Copy every initializer still in a source data file into the target's, in chunks (one under
        `SPILL_BYTES` into the graph: ORT's shape inference reads small constants such as axes inline).
        Returns the bytes the target's data file holds."""
        for tensor in graph.initializer:
            if not is_external(tensor) or tensor.name in self._spilled:
                continue
            entries = _entries(tensor)
            if int(entries["length"]) < SPILL_BYTES or tensor.name in self._transposed:  # read (and turn) here
                self._inline(tensor)
                if len(tensor.raw_data) >= SPILL_BYTES:
                    self.spill(tensor)
                continue
            length, offset = int(entries["length"]), self._pad()
            with (self.source_dir / entries["location"]).open("rb") as source:
                source.seek(int(entries.get("offset", 0)))
                left = length
                while left:
                    chunk = source.read(min(left, _CHUNK))
                    if not chunk:
                        raise BuildError(f"{entries['location']} ends inside {tensor.name}: the export's weights "
                                         "are cut short")
                    self._out.write(chunk)
                    left -= len(chunk)
            _point(tensor, self.target.name, offset, length)
        return self._out.tell()

    def close(self) -> None:
        self._out.close()  # a second close is a no-op

    def _pad(self) -> int:
        offset = self._out.tell()
        if offset % _ALIGN:
            self._out.write(b"\0" * (_ALIGN - offset % _ALIGN))
        return self._out.tell()
