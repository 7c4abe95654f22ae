"""A built engine directory, as the runtime uses it: `load_engine(dir) -> Engine`.

    engine = load_engine("out/engine")
    engine.bucket_for(tokens)               # index of the profile / bucket for a step's B tokens
    engine.cost_table("target")             # CostTable: seconds(R, B) for the scheduler
    engine.sps(requests, tokens)            # 1 / seconds
    engine.confidence_temperatures          # STS temperatures (one per block slot) or None
    engine.contract_dir                     # holds export.json (graphs → optimized files)
    engine.intra_op_threads                 # ORT session threads the engine was profiled with
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.export import contract as C
from dspark.export.manifest import sha256

from .buckets import bucket_for
from .cost_table import CostTable
from .manifest import EngineManifestError, read_engine_manifest


@dataclass(frozen=True)
class Engine:
    path: Path
    manifest: dict[str, Any]

    @property
    def backend(self) -> str:
        return self.manifest["backend"]

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(self.manifest["buckets"])

    @property
    def contract_dir(self) -> Path:
        """Directory whose export.json describes the graphs (the engine dir for ORT engines)."""
        return self.path if self.backend == "onnxruntime" else Path(self.manifest["export"]["dir"])

    @property
    def intra_op_threads(self) -> int:
        return int(self.manifest.get("session", {}).get("intra_op_threads", 1))

    def graph_path(self, name: str) -> Path:
        if name not in self.manifest["graphs"]:
            raise KeyError(f"engine {self.path} has no graph '{name}' (has {sorted(self.manifest['graphs'])})")
        return self.path / self.manifest["graphs"][name]["file"]

    def bucket_for(self, tokens: int) -> int:
        """Index of the smallest bucket (TensorRT: optimization profile) holding `tokens`."""
        return bucket_for(tokens, self.buckets)

    def cost_table(self, target_graph: str = C.TARGET) -> CostTable:
        tables = self.manifest["sps"]["tables"]
        if target_graph not in tables:
            raise KeyError(f"engine {self.path} has no SPS table for '{target_graph}' (has {sorted(tables)})")
        return CostTable.from_dict(tables[target_graph])

    def cost_model(self, kv_mode: str = "concat") -> CostTable:
        """The table for the runtime's kv_mode ('concat' → target, 'static' → target_static)."""
        return self.cost_table(C.TARGET_STATIC if kv_mode == "static" else C.TARGET)

    def sps(self, requests: int, tokens: int, target_graph: str = C.TARGET) -> float:
        return self.cost_table(target_graph).sps(requests, tokens)

    @property
    def confidence_temperatures(self) -> tuple[float, ...] | None:
        cal = self.manifest["calibration"]
        return None if cal is None else tuple(float(t) for t in cal["temperatures"])

    def verify_files(self) -> None:
        """Raise EngineManifestError if a graph/plan file is missing or differs from engine.json."""
        for name, entry in self.manifest["graphs"].items():
            path = self.path / entry["file"]
            if not path.is_file():
                raise EngineManifestError(f"engine {self.path}: graph '{name}' file {path} is missing")
            if sha256(path) != entry["sha256"]:
                raise EngineManifestError(f"engine {self.path}: {path} does not match its sha256; rebuild")


def load_engine(path: str | Path, *, verify_files: bool = False) -> Engine:
    engine = Engine(Path(path), read_engine_manifest(path))
    if verify_files:
        engine.verify_files()
    return engine
