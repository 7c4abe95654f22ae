"""`export_pair`: target + drafter folders -> ONNX graphs + export.json, checked for parity."""

from __future__ import annotations

import copy
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime as ort
import torch
from torch import nn
from tqdm import tqdm

from dspark.models import (
    DrafterConfig,
    DSparkDrafter,
    TargetConfig,
    TargetModel,
    check_drafter_fits_target,
    load_pair,
)

from . import contract as C
from . import feeds as F
from . import parity as P
from .drafter_graphs import BackboneGraph, HeadGreedyGraph, HeadStepGraph
from .fused_draft_greedy import check_joinable, export_draft_greedy_fused
from .fused_drafter import check_fusable_drafter, export_fused_backbone
from .fused_drafter_parity import fused_backbone_parity
from .fused_parity import fused_parity
from .fused_target import check_fusable, export_fused_target
from .lower import MAX_OPSET, MIN_OPSET, TWO_GB, ExportError, lower
from .manifest import FORMAT_VERSION, file_entries, model_section, write_manifest
from .target_graph import StaticCacheTargetGraph, TargetGraph

DEFAULT_OPSET = 17
# Measured with `python -m dspark.tools.export_benchmarks` (see export/README.md): one batched LM-head
# matmul in the backbone beats per-slot matmuls inside the head graphs.
DEFAULT_PLACEMENT = C.Placement(lm_head_in_backbone=True)
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_EXAMPLE = F.Case(batch=2, tokens=3, past=5)  # no dim of size 0 or 1, so nothing gets specialised


@dataclass
class GraphJob:
    spec: C.GraphSpec
    module: nn.Module
    example: tuple[torch.Tensor, ...]
    parity: Callable[[ort.InferenceSession, C.GraphSpec], dict[str, Any]]


def graph_jobs(
    target: TargetModel, drafter: DSparkDrafter, dtype: str, placement: C.Placement = DEFAULT_PLACEMENT
) -> list[GraphJob]:
    """Every graph of a pair, with the example feeds to trace it and its parity sweep."""
    td = TORCH_DTYPES[dtype]
    tc, dc = target.config, drafter.config
    g = torch.Generator().manual_seed(0)
    concat = TargetGraph(target)
    static = StaticCacheTargetGraph(target)
    backbone = BackboneGraph(drafter, placement)
    target_example = F.target_feeds(tc, _EXAMPLE, td, g)
    jobs = [
        GraphJob(
            C.target_spec(tc, dc.context_feature_size, dtype),
            concat,
            target_example,
            lambda s, spec: P.target_parity(s, spec, concat, tc, td),
        ),
        GraphJob(
            C.target_static_spec(tc, dc.context_feature_size, dtype),
            static,
            F.static_feeds(target_example, 2, g),
            lambda s, spec: P.static_parity(s, spec, target, td),
        ),
        GraphJob(
            C.backbone_spec(dc, placement, dtype),
            backbone,
            F.backbone_feeds(dc, _EXAMPLE, td, g),
            lambda s, spec: P.backbone_parity(s, spec, backbone, dc, td),
        ),
    ]
    if C.has_head_graphs(dc):
        step, greedy = HeadStepGraph(drafter, placement), HeadGreedyGraph(drafter, placement)
        inside = placement.lm_head_in_backbone
        jobs += [
            GraphJob(
                C.head_step_spec(dc, placement, dtype),
                step,
                F.head_step_feeds(dc, 2, inside, td, g),
                lambda s, spec: P.head_parity(s, spec, step, dc, placement, td, greedy=False),
            ),
            GraphJob(
                C.head_greedy_spec(dc, placement, dtype),
                greedy,
                F.head_greedy_feeds(dc, 2, inside, td, g),
                lambda s, spec: P.head_parity(s, spec, greedy, dc, placement, td, greedy=True),
            ),
        ]
    return jobs


# "plain": the traced graphs every runtime path needs (always exported). "fused": also
# `target_fused.onnx`, `target_fused_tree.onnx` (ONNX Runtime contrib ops, see fused_target.py),
# `drafter_backbone_fused.onnx` (fused_drafter.py) and `drafter_draft_greedy_fused.onnx` (fused_draft_greedy.py),
# each kept only if it passes parity. Both by default: the ONNX Runtime runtime drives the fused
# target where it exists; TensorRT and other runtimes use the plain graphs.
FLAVOURS = ("plain", "fused", "packed")
# "packed" (target_fused_packed.onnx, kv_mode "packed") is asked for: ONNX Runtime opens every graph of an engine,
# so it holds one more copy of the target's weights
DEFAULT_FLAVOURS = ("plain", "fused")


def check_pair_and_out(target_dir: Path, drafter_dir: Path, out_dir: Path) -> tuple[TargetConfig, DrafterConfig]:
    """The pair's configs, refused when the drafter does not fit the target; the output folder made.
    Runs before any weight is read, so a bad pair or --out costs nothing."""
    target_config = TargetConfig.from_folder(target_dir)
    drafter_config = DrafterConfig.from_folder(drafter_dir)
    check_drafter_fits_target(drafter_config, target_config)
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {out_dir} exists and is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    return target_config, drafter_config


def check_options(dtype: str, opset: int, flavours: Sequence[str] = ("plain",)) -> None:
    if dtype not in TORCH_DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not supported (choose one of {', '.join(C.DTYPES)})")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(f"--opset {opset} is out of range: supported opsets are {MIN_OPSET}..{MAX_OPSET}")
    unknown = [f for f in flavours if f not in FLAVOURS]
    if unknown or "plain" not in flavours:
        raise ExportError(f"flavours {list(flavours)} must include 'plain' and be among {list(FLAVOURS)}")
    if "packed" in flavours and "fused" not in flavours:
        raise ExportError("flavour 'packed' needs 'fused' too: a packed engine runs rows of one width on the "
                          "fused target graph")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def export_pair(
    target_dir: str | Path,
    drafter_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    opset: int = DEFAULT_OPSET,
    check: bool = True,
    external_data_threshold: int = TWO_GB,
    show_progress: bool = False,
    flavours: Sequence[str] = DEFAULT_FLAVOURS,
) -> dict[str, Any]:
    """Export every graph of the pair into `out_dir` and write `export.json`; returns the manifest.

    `flavours` "fused" (default) adds `target_fused.onnx`, `target_fused_tree.onnx`,
    `drafter_backbone_fused.onnx` and `drafter_draft_greedy_fused.onnx` (ONNX Runtime fused ops), "packed"
    `target_fused_packed.onnx` (verification over the real tokens only, kv_mode "packed"), each kept
    only if its model fits it and, with `check`, it passes its parity sweep; otherwise it is left out and the
    reason recorded under `dropped_graphs`. Each graph entry records its `flavour`.

    Raises CheckpointError (missing/corrupt files, unsupported architecture),
    IncompatibleDrafterError (drafter not made for this target) or ExportError (bad options).
    """
    check_options(dtype, opset, flavours)
    target_dir, drafter_dir, out_dir = Path(target_dir), Path(drafter_dir), Path(out_dir)
    target_config, drafter_config = check_pair_and_out(target_dir, drafter_dir, out_dir)

    started = time.perf_counter()
    target, drafter = load_pair(target_dir, drafter_dir, dtype=TORCH_DTYPES[dtype])
    jobs = graph_jobs(target, drafter, dtype)
    graphs: dict[str, Any] = {}
    parity: dict[str, Any] = {}
    steps = tqdm(jobs, desc="dspark-export", unit="graph", disable=not show_progress)
    for job in steps:
        steps.set_postfix_str(job.spec.name)
        t0 = time.perf_counter()
        files = lower(
            job.module,
            job.example,
            job.spec,
            out_dir,
            opset=opset,
            external_data_threshold=external_data_threshold,
        )
        graphs[job.spec.name] = {
            **job.spec.to_json(),
            "files": file_entries(files, out_dir),
            "export_seconds": round(time.perf_counter() - t0, 3),
            "flavour": "plain",
        }
        if check:
            parity[job.spec.name] = _measure(job, out_dir / job.spec.file)
    dropped: dict[str, Any] = {}
    if "fused" in flavours:
        for fused in fused_graphs(target, drafter, dtype, opset, out_dir, external_data_threshold,
                                  packed="packed" in flavours):
            _export_fused(fused, check, graphs, parity, dropped)
    manifest = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "opset": opset,
        "exporter": f"torch.onnx TorchScript tracer, torch {torch.__version__}",
        **model_section(target_config, drafter_config, target_dir),
        "lm_head_in_backbone": DEFAULT_PLACEMENT.lm_head_in_backbone,
        "flavours": list(flavours),
        "graphs": graphs,
        "dropped_graphs": dropped,
        "parity": parity if check else None,
        "export_seconds": round(time.perf_counter() - started, 3),
    }
    write_manifest(out_dir, manifest)
    # The tokenizer travels with the graphs so `dspark generate --prompt TEXT` works on the export.
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out_dir / name)
    return manifest


def _measure(job: GraphJob, path: Path) -> dict[str, Any]:
    """Parity of one graph; half-precision graphs ORT CPU has no kernels for are reported, not hidden."""
    try:
        sess = P.session(path)
        with torch.no_grad():
            return {"runtime": f"onnxruntime {ort.__version__} CPU", **job.parity(sess, job.spec)}
    except (ort.capi.onnxruntime_pybind11_state.NotImplemented, TypeError) as exc:
        return {"skipped": f"onnxruntime CPU cannot run this graph: {str(exc).splitlines()[0][:200]}"}


@dataclass(frozen=True)
class FusedGraph:
    """One fused-flavour graph: its spec, why it cannot be built (None: it can), how to write it, and its parity
    against PyTorch on an ONNX Runtime session."""

    spec: C.GraphSpec
    refusal: Callable[[], None]  # raises ExportError when the model does not fit the flavour
    write: Callable[[], list[Path]]
    parity: Callable[[ort.InferenceSession], dict[str, Any]]


def fused_graphs(target: TargetModel, drafter: DSparkDrafter, dtype: str, opset: int, out_dir: Path,
                 external_data_threshold: int, packed: bool = False) -> list[FusedGraph]:
    """`target_fused`, `target_fused_tree`, `target_fused_packed` (with `packed`), `drafter_backbone_fused` and
    `drafter_draft_greedy_fused`, in the order they are written (parity against float32 models: see
    fused_parity.TOLERANCE)."""
    out: list[FusedGraph] = []
    reference = target if dtype == "float32" else copy.deepcopy(target).float()
    for tree, packs in ((False, False), (True, False), *(((False, True),) if packed else ())):
        spec = C.target_fused_spec(target.config, drafter.config.context_feature_size, dtype, tree=tree,
                                   packed=packs)
        out.append(FusedGraph(
            spec, lambda: check_fusable(target, dtype),
            lambda tree=tree, packs=packs: export_fused_target(
                target, out_dir, dtype, opset=opset, tree=tree, packed=packs,
                external_data_threshold=external_data_threshold),
            lambda sess, spec=spec: fused_parity(sess, spec, reference, dtype)))
    spec = C.backbone_fused_spec(drafter.config, DEFAULT_PLACEMENT, dtype)
    drafter_reference = drafter if dtype == "float32" else copy.deepcopy(drafter).float()
    out.append(FusedGraph(
        spec, lambda: check_fusable_drafter(drafter, dtype),
        lambda: export_fused_backbone(drafter, DEFAULT_PLACEMENT, out_dir, dtype, opset=opset,
                                      max_positions=target.config.max_position_embeddings,
                                      external_data_threshold=external_data_threshold),
        lambda sess, spec=spec: fused_backbone_parity(sess, spec, drafter_reference, dtype)))
    spec = C.draft_greedy_fused_spec(drafter.config, DEFAULT_PLACEMENT, dtype)  # joins the graph above to the heads
    out.append(FusedGraph(
        spec, lambda: check_joinable(out_dir), lambda spec=spec: export_draft_greedy_fused(out_dir, spec),
        lambda sess, spec=spec: fused_backbone_parity(sess, spec, drafter_reference, dtype)))
    return out


def _export_fused(graph: FusedGraph, check: bool, graphs: dict[str, Any], parity: dict[str, Any],
                  dropped: dict[str, Any]) -> None:
    """Add one fused graph to `graphs`/`parity`, or its reason to `dropped` (files removed)."""
    spec = graph.spec
    try:
        graph.refusal()
    except ExportError as exc:
        dropped[spec.name] = {"reason": str(exc)}
        return
    t0 = time.perf_counter()
    files = graph.write()
    entry = {**spec.to_json(), "files": file_entries(files, files[0].parent),
             "export_seconds": round(time.perf_counter() - t0, 3), "flavour": "fused"}
    if not check:
        graphs[spec.name] = entry
        return
    try:
        sess = P.session(files[0])
        with torch.no_grad():
            result = {"runtime": f"onnxruntime {ort.__version__} CPU", **graph.parity(sess)}
    except (ort.capi.onnxruntime_pybind11_state.NotImplemented, TypeError) as exc:
        # e.g. no bfloat16 GroupQueryAttention kernel on CPU: kept as the other graphs are, reported
        result = {"skipped": f"onnxruntime CPU cannot run this graph: {str(exc).splitlines()[0][:200]}"}
    if result.get("passed", True):
        graphs[spec.name] = entry
        parity[spec.name] = result
        return
    for path in files:
        path.unlink()
    dropped[spec.name] = {"reason": "parity against PyTorch failed", "parity": result}
