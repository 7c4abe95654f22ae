"""The ONNX Runtime backend: the graphs of a `dspark-export` directory, run through IO binding.

Graph specs come from `export.json` (the export contract), so feeds are checked without
opening the ONNX files. Each session is created on first use. Inputs are bound, not copied,
when they are contiguous: a torch tensor shares its memory with the numpy view handed to
ORT (`bind_cpu_input`), which is how the static-cache graph reads the runtime's slot buffers
in place. Non-contiguous feeds (the concat graph's past, a slice of the slot buffers) are
copied once into a contiguous array: that copy is exactly the KV traffic the static path avoids.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from dspark.export import contract as C
from dspark.export.manifest import read_manifest

from .backend import Array, Backend


def spec_from_json(name: str, entry: dict) -> C.GraphSpec:
    def tensors(items: list[dict]) -> tuple[C.TensorSpec, ...]:
        return tuple(C.TensorSpec(t["name"], t["dtype"], tuple(t["dims"])) for t in items)

    return C.GraphSpec(name, tensors(entry["inputs"]), tensors(entry["outputs"]))


def as_numpy(value: Array) -> np.ndarray:
    array = value.numpy() if isinstance(value, torch.Tensor) else value
    return np.ascontiguousarray(array)  # no copy when already contiguous


class OrtBackend(Backend):
    def __init__(
        self,
        export_dir: str | Path,
        *,
        providers: list[str] | None = None,
        intra_op_threads: int = 0,  # 0 = ORT's default (all cores)
    ) -> None:
        super().__init__()
        self.export_dir = Path(export_dir)
        self.manifest = read_manifest(self.export_dir)
        if self.manifest["dtype"] != "float32":
            raise ValueError(f"{export_dir}: the ORT CPU runtime runs float32 exports, this one is "
                             f"{self.manifest['dtype']}; re-export with --dtype float32")
        graphs = self.manifest["graphs"]
        self._specs = {name: spec_from_json(name, entry) for name, entry in graphs.items()}
        self._files = {name: self.export_dir / entry["file"] for name, entry in graphs.items()}
        self.providers = providers or ["CPUExecutionProvider"]
        self.options = ort.SessionOptions()
        self.options.intra_op_num_threads = intra_op_threads
        self.options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._sessions: dict[str, ort.InferenceSession] = {}

    @property
    def specs(self) -> dict[str, C.GraphSpec]:
        return self._specs

    def session(self, graph: str) -> ort.InferenceSession:
        if graph not in self._sessions:
            self._sessions[graph] = ort.InferenceSession(
                str(self._files[graph]), self.options, providers=self.providers
            )
        return self._sessions[graph]

    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        session = self.session(graph)
        binding = session.io_binding()
        keep = []  # numpy arrays must outlive the run
        for name in self._specs[graph].input_names:
            array = as_numpy(feeds[name])
            keep.append(array)
            binding.bind_cpu_input(name, array)
        names = self._specs[graph].output_names
        for name in names:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        return dict(zip(names, binding.copy_outputs_to_cpu(), strict=True))
