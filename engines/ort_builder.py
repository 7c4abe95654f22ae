"""The ONNX Runtime engine: graphs optimized once by ORT and saved, plus the session config.

Each graph of the export is loaded with `graph_optimization_level` and `optimized_model_filepath`
set, which makes ORT write the optimized graph (fused attention/MatMul/LayerNorm patterns,
constant folding, and at level `all` layout and hardware-specific fusions: such a graph is meant
for machines like the build machine). The engine directory then holds:

    graphs/<name>.onnx   the optimized graphs (external `.onnx.data` when the source had one)
    export.json          the export's contract, its graph entries pointing at graphs/ (so
                         `Runtime.load(engine_dir)` drives the engine like an export dir)
    tokenizer.json       copied from the export when present (`dspark generate --prompt`)
    engine.json          see manifest.py

Sessions are created with intra-op threads = `threads` (1 measured fastest on the shared 2-core
build machine; the runtime reads the value from engine.json) and sequential execution.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnxruntime as ort

from dspark.export.manifest import MANIFEST, file_entries, write_manifest

GRAPH_DIR = "graphs"
LEVELS = {
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def session_options(level: str, threads: int, optimized_path: Path | None = None,
                    external_data: str | None = None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = LEVELS[level]
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
        if external_data is not None:
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                             external_data)
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                             "1024")
    return options


def optimize_graph(source: Path, target: Path, *, level: str, threads: int, has_external_data: bool) -> None:
    """Let ORT optimize `source` and write the result to `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    external = f"{target.name}.data" if has_external_data else None
    options = session_options(level, threads, target, external)
    options.log_severity_level = 3  # ORT warns that level-`all` graphs are hardware specific: documented above
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    if not target.is_file():
        raise RuntimeError(f"onnxruntime did not write the optimized graph {target}")


def build_ort_graphs(
    export_dir: Path,
    export_manifest: dict[str, Any],
    out_dir: Path,
    *,
    level: str = "all",
    threads: int = 1,
    progress: Callable[[str], None] | None = None,
    derived_from: Path | None = None,
) -> dict[str, Any]:
    """Optimize every graph into out_dir/graphs, write the derived export.json and copy the tokenizer.
    `derived_from`: the export to name in it when `export_dir` is a staged copy (quantized graphs).
    Returns engine.json's `graphs` section."""
    if level not in LEVELS:
        raise ValueError(f"optimization level {level!r} is not one of {sorted(LEVELS)}")
    derived = dict(export_manifest)
    derived["graphs"] = {}
    section = {}
    for name, entry in export_manifest["graphs"].items():
        if progress:
            progress(f"optimizing {name}")
        source = export_dir / entry["file"]
        target = out_dir / GRAPH_DIR / entry["file"]
        optimize_graph(source, target, level=level, threads=threads,
                       has_external_data=len(entry.get("files", [])) > 1)
        files = [target, *([target.with_name(target.name + ".data")]
                           if target.with_name(target.name + ".data").is_file() else [])]
        entries = file_entries(files, out_dir)
        derived["graphs"][name] = {**entry, "file": f"{GRAPH_DIR}/{entry['file']}", "files": entries}
        section[name] = {"file": entries[0]["path"], "bytes": sum(e["bytes"] for e in entries),
                         "sha256": entries[0]["sha256"], "files": entries, "source": entry["file"]}
    derived["derived_from"] = {"export_dir": str((derived_from or export_dir).resolve()),
                               "by": "dspark-build-engine (onnxruntime)"}
    write_manifest(out_dir, derived)
    tokenizer = (derived_from or export_dir) / "tokenizer.json"
    if tokenizer.is_file():
        shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    return section


def session_section(level: str, threads: int, spinning: bool = False) -> dict[str, Any]:
    return {"graph_optimization_level": level, "intra_op_threads": threads, "intra_op_spinning": spinning,
            "inter_op_threads": 1,
            "execution_mode": "sequential", "providers": ["CPUExecutionProvider"],
            "onnxruntime": ort.__version__, "contract": MANIFEST}
