"""An engine directory as the runtime reads it and the builders write it: `engine.json` (schema,
SPS cost tables, STS temperatures, backend), bucket lookup, and `EngineDir`.

    engine = load_engine_dir("out/engine")  # ArtifactError naming the file and field when it is bad
    engine.backend                          # "onnxruntime" | "tensorrt": which runtime backend opens it
    engine.contract_dir                     # holds export.json (graph specs; ORT: the optimized files)
    engine.kv_mode                          # "fused" | "concat" | "static": the target graph it drives
    engine.cost_model(kv_mode)              # CostTable: seconds(R, B) for the scheduler
    engine.bucket_for(tokens)               # index of the profile / bucket for a step's B tokens
    engine.confidence_temperatures          # STS temperatures (one per block slot) or None

`engine.json`: what an engine directory holds, how it was built, its SPS table and STS temperatures.

    format_version  1
    kind            "dspark-engine"
    backend         "onnxruntime" | "tensorrt"
    export          {dir: the source dspark-export dir (absolute), manifest_sha256}
    graphs          {name: {file (relative to the engine dir), bytes, sha256, source (export file)}}
    limits          {max_batch, max_seq_len, verify_width, max_batch_tokens}
    buckets         [B_1 < B_2 < ...] verified-token bounds; TensorRT: one profile each
    session         ORT: {graph_optimization_level, intra_op_threads, intra_op_spinning, inter_op_threads,
                    execution_mode}
    tensorrt        TRT: {flavour ("tensorrt" | "tensorrt-rtx"; absent section: tensorrt), version,
                    compute_capabilities ["8.9", ...], ahead_of_time, plugin_library, timing_cache,
                    runtime_cache, strongly_typed, profiles: {graph: [...]}, build_seconds, skipped,
                    comparison: Polygraphy TRT-vs-ORT result, null when built ahead of time}
    quantization    optional, null or ORT weight-only: {scheme "int4" | "int8", bits, block_size, symmetric,
                    accuracy_level, drafter (drafter graphs too), quantizer, onnxruntime,
                    graphs: {name: {matmuls, quantized, left_float}}} (engines/quantize.py)
    kv_mode         optional, "fused" | "static" | "concat": the target graph the runtime drives by default
                    (contract.KV_MODE_GRAPHS); absent in older engines: fused where the graphs have it
    sps             null only when built ahead of time (no GPU to measure on: --reprofile there), else
                    profiling.profile_section: {measured_at, past, warmup, repeats, statistic,
                    load_before, load_after, seconds, tables: {target graph: CostTable.to_dict()}}
    calibration     null or {temperatures [γ], ece_before [γ], ece_after [γ], ece_before_mean,
                    ece_after_mean, bins, grid, samples, sequences, data, diagram}
    built_with      {dspark, onnxruntime, tensorrt, python, platform, cpu_count}
    build_seconds   float

`validate` checks all of it and raises ArtifactError naming the file and the first bad field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from . import contract as C
from .artifacts import ArtifactError, check_sha256, read_json_object
from .cost_table import CostTable

ENGINE_JSON = "engine.json"
FORMAT_VERSION = 1
KIND = "dspark-engine"
BACKENDS = ("onnxruntime", "tensorrt")
TRT_FLAVOURS = ("tensorrt", "tensorrt-rtx")  # runtime/trt_flavours.py FLAVOURS
_REQUIRED = ("format_version", "kind", "backend", "export", "graphs", "limits", "buckets", "sps",
             "calibration", "built_with", "build_seconds")


REBUILD = "rebuild the engine with dspark-build-engine"


class BucketError(ValueError):
    """A bucket list, limit or step size that cannot be used (bad text, not increasing, out of range)."""


def _fail(where: str, message: str) -> None:
    raise ArtifactError(where, message, REBUILD)


def _positive_ints(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and v >= 1 for v in value)


def _increasing(values: list[int]) -> bool:
    return all(b > a for a, b in pairwise(values))


def validate(manifest: Any, where: str = ENGINE_JSON) -> dict[str, Any]:
    """Return `manifest` if it follows the schema; raise ArtifactError otherwise."""
    if not isinstance(manifest, dict):
        _fail(where, "expected a JSON object")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        _fail(where, f"missing fields {missing}")
    if manifest["format_version"] != FORMAT_VERSION:
        _fail(where, f"format_version {manifest['format_version']!r} is not {FORMAT_VERSION}")
    if manifest["kind"] != KIND:
        _fail(where, f"kind {manifest['kind']!r} is not {KIND!r}")
    if manifest["backend"] not in BACKENDS:
        _fail(where, f"backend {manifest['backend']!r} is not one of {BACKENDS}")
    graphs = manifest["graphs"]
    if not isinstance(graphs, dict) or not graphs:
        _fail(where, "graphs must be a non-empty object")
    for name, entry in graphs.items():
        if not isinstance(entry, dict) or not {"file", "sha256", "bytes"} <= entry.keys():
            _fail(where, f"graphs.{name} needs file, bytes and sha256")
    limits = manifest["limits"]
    for key in ("max_batch", "max_seq_len", "verify_width", "max_batch_tokens"):
        if not isinstance(limits, dict) or not isinstance(limits.get(key), int) or limits[key] < 1:
            _fail(where, f"limits.{key} must be a positive integer")
    buckets = manifest["buckets"]
    if not _positive_ints(buckets) or not _increasing(buckets):
        _fail(where, f"buckets must be strictly increasing positive integers, got {buckets!r}")
    if buckets[-1] > limits["max_batch_tokens"]:
        _fail(where, f"largest bucket {buckets[-1]} exceeds limits.max_batch_tokens {limits['max_batch_tokens']}")
    kv_mode = manifest.get("kv_mode")
    if kv_mode is not None and (kv_mode not in C.KV_MODE_GRAPHS or C.KV_MODE_GRAPHS[kv_mode] not in graphs):
        _fail(where, f"kv_mode {kv_mode!r} must be one of {sorted(C.KV_MODE_GRAPHS)} and its graph must be "
                     "in graphs")
    _validate_quantization(manifest, where)
    ahead_of_time = _validate_tensorrt(manifest, where)
    if manifest["sps"] is not None or not ahead_of_time:
        _validate_sps(manifest["sps"], where)
    if manifest["calibration"] is not None:
        _validate_calibration(manifest["calibration"], limits["verify_width"] - 1, where)
    return manifest


QUANT_SCHEMES = {"int4": 4, "int8": 8}  # engines/quantize.py SCHEMES


def _validate_quantization(manifest: dict[str, Any], where: str) -> None:
    section = manifest.get("quantization")
    if section is None:
        return
    if manifest["backend"] != "onnxruntime" or not isinstance(section, dict):
        _fail(where, "quantization must be an object, and only in an engine whose backend is onnxruntime")
    scheme = section.get("scheme")
    if scheme not in QUANT_SCHEMES or section.get("bits") != QUANT_SCHEMES[scheme]:
        _fail(where, f"quantization.scheme/bits {scheme!r}/{section.get('bits')!r} must be int4/4 or int8/8")
    graphs = section.get("graphs")
    if not isinstance(graphs, dict) or not graphs or any(name not in manifest["graphs"] for name in graphs):
        _fail(where, "quantization.graphs must name graphs of the engine")


def _validate_tensorrt(manifest: dict[str, Any], where: str) -> bool:
    """Check the `tensorrt` section (optional); True when the engine was built ahead of time."""
    section = manifest.get("tensorrt")
    if section is None:
        return False
    if manifest["backend"] != "tensorrt" or not isinstance(section, dict):
        _fail(where, "tensorrt must be an object, and only in an engine whose backend is tensorrt")
    if section.get("flavour") not in TRT_FLAVOURS:
        _fail(where, f"tensorrt.flavour {section.get('flavour')!r} is not one of {TRT_FLAVOURS}")
    if not isinstance(section.get("version"), str) or not section["version"]:
        _fail(where, "tensorrt.version must name the TensorRT version that built the plans")
    ccs = section.get("compute_capabilities")
    if not isinstance(ccs, list) or not all(isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc) for cc in ccs):
        _fail(where, f"tensorrt.compute_capabilities must list versions such as '8.9', got {ccs!r}")
    if section["flavour"] == "tensorrt-rtx" and not ccs:
        _fail(where, "tensorrt.compute_capabilities: a tensorrt-rtx engine names the GPUs its plans run on")
    if not isinstance(section.get("ahead_of_time", False), bool):
        _fail(where, "tensorrt.ahead_of_time must be true or false")
    return section.get("ahead_of_time", False)


def _validate_sps(sps: Any, where: str) -> None:
    if not isinstance(sps, dict) or not isinstance(sps.get("tables"), dict) or not sps["tables"]:
        _fail(where, "sps.tables must hold at least one measured table")
    for graph, table in sps["tables"].items():
        at = f"sps.tables.{graph}"
        if not isinstance(table, dict) or not _positive_ints(table.get("batches")) or not _positive_ints(
            table.get("buckets")
        ):
            _fail(where, f"{at} needs batches and buckets (positive integers)")
        rows, cols = len(table["batches"]), len(table["buckets"])
        verify, draft = table.get("verify_seconds"), table.get("draft_seconds")
        if not isinstance(verify, list) or len(verify) != rows or any(
            not isinstance(row, list) or len(row) != cols for row in verify
        ):
            _fail(where, f"{at}.verify_seconds must be a {rows} x {cols} list")
        if any(v is not None and not (isinstance(v, float | int) and v > 0) for row in verify for v in row):
            _fail(where, f"{at}.verify_seconds entries must be positive seconds or null")
        if not isinstance(draft, list) or len(draft) != rows or any(
            not isinstance(v, float | int) or v < 0 for v in draft
        ):
            _fail(where, f"{at}.draft_seconds must be {rows} non-negative seconds")


def _validate_calibration(cal: Any, block: int, where: str) -> None:
    if not isinstance(cal, dict):
        _fail(where, "calibration must be null or an object")
    for key in ("temperatures", "ece_before", "ece_after"):
        values = cal.get(key)
        if not isinstance(values, list) or len(values) != block:
            _fail(where, f"calibration.{key} must list one value per block slot ({block})")
    if any(not isinstance(t, float | int) or t <= 0 for t in cal["temperatures"]):
        _fail(where, "calibration.temperatures must be > 0")


def read_engine_manifest(engine_dir: str | Path) -> dict[str, Any]:
    path = Path(engine_dir) / ENGINE_JSON
    return validate(read_json_object(path, REBUILD), str(path))


def write_engine_manifest(engine_dir: str | Path, manifest: dict[str, Any]) -> Path:
    validate(manifest)
    path = Path(engine_dir) / ENGINE_JSON
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)  # --reprofile / calibrate rewrite in place: never leave a half-written file
    return path


def bucket_for(tokens: int, buckets: Sequence[int]) -> int:
    """Index of the smallest bucket holding `tokens` verified tokens."""
    if tokens < 1:
        raise BucketError(f"a step verifies at least 1 token, got {tokens}")
    for index, bound in enumerate(buckets):
        if tokens <= bound:
            return index
    raise BucketError(f"{tokens} tokens exceed the largest bucket {buckets[-1]}; rebuild with a larger "
                      f"--max-batch-tokens or admit fewer tokens per step")


@dataclass(frozen=True)
class EngineDir:
    """A checked engine directory: its path and its engine.json."""

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

    @property
    def intra_op_spinning(self) -> bool:
        """Engines built before the setting existed ran ORT's default: spinning."""
        return bool(self.manifest.get("session", {}).get("intra_op_spinning", True))

    def graph_path(self, name: str) -> Path:
        """The built file of one graph (ORT: optimized ONNX; TensorRT: the plan)."""
        if name not in self.manifest["graphs"]:
            raise ArtifactError(self.path / ENGINE_JSON, f"has no graph '{name}' "
                                f"(has {sorted(self.manifest['graphs'])})", REBUILD)
        return self.path / self.manifest["graphs"][name]["file"]

    def bucket_for(self, tokens: int) -> int:
        """Index of the smallest bucket (TensorRT: optimization profile) holding `tokens`."""
        return bucket_for(tokens, self.buckets)

    def cost_table(self, target_graph: str = C.TARGET) -> CostTable:
        if self.manifest["sps"] is None:
            raise ArtifactError(self.path / ENGINE_JSON, "has no SPS table (built ahead of time, without the GPU "
                                "it runs on)", f"run dspark-build-engine EXPORT --out {self.path} --reprofile "
                                "on that GPU")
        tables = self.manifest["sps"]["tables"]
        if target_graph not in tables:
            raise ArtifactError(self.path / ENGINE_JSON, f"has no SPS table for '{target_graph}' "
                                f"(has {sorted(tables)})", "rebuild, or pick the kv mode it was built for")
        return CostTable.from_dict(tables[target_graph])

    @property
    def kv_mode(self) -> str:
        """The target graph flavour the runtime drives unless told otherwise."""
        recorded = self.manifest.get("kv_mode")
        if recorded is not None:
            return recorded
        return "fused" if C.TARGET_FUSED in self.manifest["graphs"] else "concat"

    def cost_model(self, kv_mode: str | None = None) -> CostTable:
        """The table of the target graph `kv_mode` drives (None: the engine's own kv_mode)."""
        return self.cost_table(C.KV_MODE_GRAPHS[kv_mode or self.kv_mode])

    @property
    def confidence_temperatures(self) -> tuple[float, ...] | None:
        cal = self.manifest["calibration"]
        return None if cal is None else tuple(float(t) for t in cal["temperatures"])

    def verify_files(self) -> None:
        """ArtifactError if a graph/plan file is missing or differs from engine.json."""
        for entry in self.manifest["graphs"].values():
            check_sha256(self.path / entry["file"], entry["sha256"], REBUILD)


def is_engine_dir(path: str | Path) -> bool:
    return (Path(path) / ENGINE_JSON).is_file()


def load_engine_dir(path: str | Path, *, verify_files: bool = False) -> EngineDir:
    engine = EngineDir(Path(path), read_engine_manifest(path))
    if verify_files:
        engine.verify_files()
    return engine
