"""The ONNX Runtime backend: the graphs of a `dspark-export` directory (or of an ORT engine
directory, which holds a derived export.json over its optimized graphs), run through IO binding.

Graph specs come from `export.json` (the export contract), so feeds are checked without
opening the ONNX files. `open()` creates every session, so a truncated or garbage graph file
is reported at load as an ArtifactError naming the file. Inputs are bound, not copied,
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
from dspark.export.artifacts import ArtifactError, first_line
from dspark.export.engine_dir import EngineDir
from dspark.export.manifest import graph_specs, read_manifest, remedy

from .backend import Array, Backend, BoundCall

CPU = "CPUExecutionProvider"


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
        intra_op_spinning: bool = False,  # worker threads busy-wait between calls (ORT's default: True)
        of_engine: bool = False,  # read for an engine (for_engine): its derived export.json is expected
    ) -> None:
        super().__init__()
        self.export_dir = Path(export_dir)
        self.manifest = read_manifest(self.export_dir, of_engine=of_engine)
        if self.manifest["dtype"] != "float32" and (providers or [CPU]) == [CPU]:
            raise ArtifactError(self.export_dir / "export.json", f"holds {self.manifest['dtype']} graphs, which "
                                "ONNX Runtime's CPU provider cannot run", "re-export with --dtype float32")
        self._specs = graph_specs(self.manifest)
        self._files = {name: self.export_dir / entry["file"] for name, entry in self.manifest["graphs"].items()}
        self.providers = providers or [CPU]
        missing = [p for p in self.providers if p not in ort.get_available_providers()]
        if missing:
            raise ArtifactError(self.export_dir, f"needs ONNX Runtime providers {missing}, which this onnxruntime "
                                f"{ort.__version__} lacks", "install onnxruntime-gpu for CUDA, or use the CPU")
        self.options = ort.SessionOptions()
        self.options.intra_op_num_threads = intra_op_threads
        # Spinning workers hold a core between graph calls, which the engine's own Python and a server's
        # threads need on a small CPU; on 2 cores sleeping ones cost nothing measurable (docs/recovery.md).
        self.options.add_session_config_entry("session.intra_op.allow_spinning", "1" if intra_op_spinning else "0")
        self.options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._sessions: dict[str, ort.InferenceSession] = {}

    @classmethod
    def for_engine(cls, engine: EngineDir, threads: int | None = None) -> OrtBackend:
        """The engine's sessions, with its intra-op thread count unless `threads` replaces it."""
        session = engine.manifest.get("session", {})
        return cls(engine.contract_dir, providers=session.get("providers"),
                   intra_op_threads=engine.intra_op_threads if threads is None else threads,
                   intra_op_spinning=engine.intra_op_spinning, of_engine=True)

    @property
    def specs(self) -> dict[str, C.GraphSpec]:
        return self._specs

    def _open(self) -> None:
        for graph, path in self._files.items():
            try:
                self._sessions[graph] = ort.InferenceSession(str(path), self.options, providers=self.providers)
            except Exception as exc:  # ORT raises its own pybind types (InvalidProtobuf, Fail, ...)
                self._sessions.clear()
                raise ArtifactError(path, f"ONNX Runtime cannot load it ({first_line(exc)})",
                                    remedy(self.export_dir)) from None

    def _close(self) -> None:
        self._sessions.clear()

    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        session = self._sessions[graph]
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

    def bind(self, graph: str, feeds: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> BoundCall:
        """IO binding over OrtValues that wrap the arrays' own memory, made once."""
        self._check(graph, feeds)
        session = self._sessions[graph]
        binding = session.io_binding()
        values = {}  # an array fed and output is one OrtValue: one buffer, updated in place
        keep = []  # the OrtValues must live as long as the binding
        for name in self._specs[graph].input_names:
            array = feeds[name]
            if not array.flags.c_contiguous:  # a silent copy would break buffers updated in place
                raise ValueError(f"graph '{graph}': feed '{name}' must be C-contiguous to be bound")
            values[id(array)] = value = ort.OrtValue.ortvalue_from_numpy(array)
            binding.bind_ortvalue_input(name, value)
        for name in self._specs[graph].output_names:
            array = outputs.get(name)
            if array is None:
                binding.bind_output(name, "cpu")
                continue
            if not array.flags.c_contiguous:
                raise ValueError(f"graph '{graph}': output array for '{name}' must be C-contiguous")
            value = values.get(id(array)) or ort.OrtValue.ortvalue_from_numpy(array)
            keep.append(value)
            binding.bind_ortvalue_output(name, value)
        keep += values.values()

        return BoundCall(graph, lambda: session.run_with_iobinding(binding), self.times, holds=keep)
