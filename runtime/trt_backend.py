"""The TensorRT backend: an engine directory's serialized plans, run by graph name.

Each target plan holds one optimization profile per token bucket (engine.json `buckets`); a call
[R, T] runs on the profile of the smallest bucket holding R·T tokens. The drafter plans have one
profile. Plans run through Polygraphy's TrtRunner (host arrays in and out). `import tensorrt`
happens in `open()` only, so this module imports anywhere; without TensorRT, opening raises
BackendUnavailable with the one line that says what to install.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from dspark.export import contract as C
from dspark.export.artifacts import check_size
from dspark.export.engine_dir import REBUILD, EngineDir
from dspark.export.manifest import graph_specs, read_manifest

from .backend import Array, Backend, BackendUnavailable

INSTALL_HINT = ('TensorRT is not installed: pip install "dspark[tensorrt]" '
                "(needs an NVIDIA GPU with its driver; or build with --backend onnxruntime)")
TARGET_GRAPHS = (C.TARGET, C.TARGET_STATIC)


class TensorRTUnavailable(BackendUnavailable):
    """TensorRT (or Polygraphy) cannot be imported, or is too old."""


def trt_major(version: str) -> int:
    return int(version.split(".")[0])


def import_tensorrt() -> Any:
    try:
        import tensorrt as trt
    except ImportError:
        raise TensorRTUnavailable(INSTALL_HINT) from None
    if trt_major(trt.__version__) < 10:
        raise TensorRTUnavailable(f"TensorRT {trt.__version__} is too old: dspark needs TensorRT >= 10 "
                                  f'(pip install "dspark[tensorrt]")')
    return trt


class TrtBackend(Backend):
    def __init__(self, engine: EngineDir, specs: Mapping[str, C.GraphSpec]) -> None:
        super().__init__()
        self.engine = engine
        self._specs = {name: specs[name] for name in engine.manifest["graphs"]}
        self._runners: dict[tuple[str, int], Any] = {}

    @classmethod
    def for_engine(cls, engine: EngineDir) -> TrtBackend:
        """Specs from the source export's export.json (engine.json `export.dir`)."""
        return cls(engine, graph_specs(read_manifest(engine.contract_dir, verify="none")))

    @property
    def specs(self) -> dict[str, C.GraphSpec]:
        return self._specs

    def _open(self) -> None:
        trt = import_tensorrt()
        try:
            from polygraphy.backend.trt import EngineFromBytes, TrtRunner
        except ImportError:
            raise TensorRTUnavailable('Polygraphy is not installed: pip install "dspark[tensorrt]"') from None
        library = self.engine.manifest.get("tensorrt", {}).get("plugin_library")
        if library:
            trt.init_libnvinfer_plugins(trt.Logger(trt.Logger.WARNING), "")
            trt.get_plugin_registry().load_library(library)
        for name, entry in self.engine.manifest["graphs"].items():
            path = self.engine.graph_path(name)
            check_size(path, entry["bytes"], REBUILD)
            plan = path.read_bytes()
            for k in range(len(self.engine.buckets) if name in TARGET_GRAPHS else 1):
                runner = TrtRunner(EngineFromBytes(plan), optimization_profile=k)
                runner.activate()
                self._runners[name, k] = runner

    def _close(self) -> None:
        for runner in self._runners.values():
            runner.deactivate()
        self._runners.clear()

    def profile_for(self, graph: str, feeds: Mapping[str, Array]) -> int:
        """The optimization profile a call runs on: its bucket for target graphs, else 0."""
        if graph not in TARGET_GRAPHS:
            return 0
        batch, tokens = feeds["input_ids"].shape
        return self.engine.bucket_for(batch * tokens)

    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        host = {name: np.ascontiguousarray(value) for name, value in feeds.items()}
        return self._runners[graph, self.profile_for(graph, feeds)].infer(host)
