"""`build_engine`: export dir -> engine dir (graphs or plans, buckets, SPS table, optional STS).

Stages, each its own function: read and verify the export → plan buckets and shape limits →
build (ort_builder / trt_builder) → profile SPS on this machine → calibrate (optional) → write
engine.json. `reprofile` and `calibrate_engine` rewrite one section of an existing engine.json.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from dspark.export import contract as C
from dspark.export.artifacts import sha256
from dspark.export.engine_dir import (
    ENGINE_JSON,
    FORMAT_VERSION,
    KIND,
    TRT_FLAVOURS,
    EngineDir,
    load_engine_dir,
    write_engine_manifest,
)
from dspark.export.manifest import graph_specs, read_manifest
from dspark.runtime.backend_registry import backend_factory, open_backend

from .buckets import BucketError, ShapeLimits, plan_buckets
from .calibration import evaluate, fit_sts, reliability_diagram
from .calibration_data import collect_rounds, read_sequences
from .export_source import BuildError, load_export
from .ort_builder import build_ort_graphs, session_section
from .profiling import profile_batches, profile_section
from .quantize import QuantizeOptions, quantized_source

Progress = Callable[[str], None] | None
DIAGRAM = "calibration.png"


@dataclass(frozen=True)
class BuildOptions:
    backend: str = "onnxruntime"  # or "tensorrt", "tensorrt-rtx" (engine.json backend tensorrt, flavour named)
    buckets: tuple[int, ...] | None = None  # None: powers of two up to max_batch_tokens
    max_batch_tokens: int = 64
    max_batch: int = 8
    max_seq_len: int = 1024
    threads: int = 1
    spinning: bool = False  # ORT's worker threads busy-wait between calls (with threads != 1)
    optimization_level: str = "all"
    profile_past: int = 64
    warmup: int = 2
    repeats: int = 5
    compute_capabilities: tuple[str, ...] = ()  # tensorrt-rtx: the GPUs to build for ("8.9"); () = its default
    quantize: QuantizeOptions | None = None  # weight-only int4/int8 (onnxruntime backend only)


def _limits(export: dict[str, Any], options: BuildOptions) -> ShapeLimits:
    if options.max_batch < 1 or options.max_seq_len < 1:
        raise BucketError("--max-batch and --max-seq-len must be >= 1")
    return ShapeLimits(max_batch=options.max_batch,
                       max_seq_len=min(options.max_seq_len, export["target"]["max_position_embeddings"]),
                       verify_width=1 + export["drafter"]["block_size"])


def _check_quantize(options: BuildOptions, export: dict[str, Any]) -> None:
    """Refuse a quantized build this backend or export cannot make, before any work."""
    if options.backend != "onnxruntime":
        raise BuildError(f"--quantize makes weight-only ONNX Runtime engines (MatMulNBits); --backend "
                         f"{options.backend} cannot run them: drop --quantize or use --backend onnxruntime")
    if export["dtype"] != "float32":
        raise BuildError(f"--quantize starts from a float32 export, this one is {export['dtype']}: "
                         "re-export with --dtype float32")
    options.quantize.check()


def _built_with() -> dict[str, Any]:
    versions = {}
    for package in ("dspark", "onnxruntime", "tensorrt", "tensorrt_rtx"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {**versions, "python": sys.version.split()[0], "platform": platform.platform(),
            "processor": platform.processor() or platform.machine()}


def build_engine(export_dir: str | Path, out_dir: str | Path, options: BuildOptions = BuildOptions(), *,
                 calibrate_data: str | Path | None = None, tokenizer: str | Path | None = None,
                 progress: Progress = None) -> dict[str, Any]:
    """Build, profile and (optionally) calibrate; returns the written engine.json."""
    begin = time.perf_counter()
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    export = load_export(export_dir)
    if options.quantize is not None:
        _check_quantize(options, export)
    flavour = None
    if options.backend in TRT_FLAVOURS:
        from dspark.runtime.trt_flavours import flavour_named, import_flavour

        flavour = flavour_named(options.backend)
        import_flavour(flavour)  # fail before creating anything
    limits = _limits(export, options)
    buckets = plan_buckets(options.max_batch_tokens, options.buckets)
    if out_dir.exists() and not out_dir.is_dir():
        raise BuildError(f"--out {out_dir} exists and is not a directory")
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "kind": KIND, "backend": "tensorrt" if flavour else options.backend,
        "export": {"dir": str(export_dir.resolve()), "manifest_sha256": sha256(export_dir / "export.json"),
                   "dtype": export["dtype"]},
        "limits": {"max_batch": limits.max_batch, "max_seq_len": limits.max_seq_len,
                   "verify_width": limits.verify_width, "max_batch_tokens": options.max_batch_tokens},
        "buckets": list(buckets),
    }
    if options.backend == "onnxruntime":
        if export["dtype"] != "float32":
            raise BuildError(f"the ONNX Runtime CPU engine runs float32 exports, {export_dir} is {export['dtype']}: "
                             f"re-export with --dtype float32 or build with --backend tensorrt")
        out_dir.mkdir(parents=True, exist_ok=True)
        with quantized_source(export_dir, export, out_dir, options.quantize, progress) as (source_dir, source, q):
            manifest["graphs"] = build_ort_graphs(source_dir, source, out_dir, level=options.optimization_level,
                                                  threads=options.threads, progress=progress, derived_from=export_dir)
        manifest["quantization"] = q
        manifest["session"] = session_section(options.optimization_level, options.threads, options.spinning)
    elif flavour is not None:
        from .trt_builder import build_trt

        out_dir.mkdir(parents=True, exist_ok=True)
        manifest["graphs"], manifest["tensorrt"] = build_trt(
            export_dir, export, out_dir, flavour=flavour, buckets=buckets, limits=limits,
            compute_capabilities=options.compute_capabilities, progress=progress)
    else:
        raise BuildError(f"--backend {options.backend!r} is not one of onnxruntime, {', '.join(TRT_FLAVOURS)}")
    manifest["kv_mode"] = "fused" if C.TARGET_FUSED in manifest["graphs"] else "concat"
    # Built ahead of time (no GPU here): the SPS table is measured by --reprofile on the GPU.
    ahead_of_time = flavour is not None and flavour.ahead_of_time
    manifest["sps"] = None if ahead_of_time else _profile(out_dir, manifest, export, options, progress)
    manifest["calibration"] = None
    manifest["built_with"] = _built_with()
    manifest["build_seconds"] = round(time.perf_counter() - begin, 2)
    write_engine_manifest(out_dir, manifest)
    if calibrate_data is not None:
        manifest = calibrate_engine(out_dir, calibrate_data, tokenizer=tokenizer, progress=progress)
    return manifest


def _profile(out_dir: Path, manifest: dict[str, Any], export: dict[str, Any], options: BuildOptions,
             progress: Progress) -> dict[str, Any]:
    specs = graph_specs(export)
    buckets, limits = tuple(manifest["buckets"]), manifest["limits"]
    batches = profile_batches(min(limits["max_batch"], buckets[-1]))
    past = min(options.profile_past, limits["max_seq_len"])
    common = dict(vocab_size=export["target"]["vocab_size"], block_size=export["drafter"]["block_size"],
                  batches=batches, buckets=buckets, past=past, warmup=options.warmup, repeats=options.repeats,
                  progress=progress)
    # The backend the runtime will serve this engine with, so the table prices what will run.
    with backend_factory(manifest["backend"])(EngineDir(out_dir, manifest)) as backend:
        backend.check_inputs = False
        return profile_section(backend.run, specs, bind=backend.bind, **common)


def reprofile(engine_dir: str | Path, *, warmup: int | None = None, repeats: int | None = None,
              progress: Progress = None) -> dict[str, Any]:
    """Measure the SPS table again on this machine and rewrite it in engine.json (nothing else changes)."""
    engine = load_engine_dir(engine_dir, verify_files=True)
    manifest = engine.manifest
    export = load_export(manifest["export"]["dir"], verify_files=False)
    old = manifest["sps"] or {"past": BuildOptions.profile_past, "warmup": BuildOptions.warmup,
                              "repeats": BuildOptions.repeats}  # built ahead of time: never measured
    options = BuildOptions(backend=manifest["backend"], profile_past=old["past"],
                           warmup=old["warmup"] if warmup is None else warmup,
                           repeats=old["repeats"] if repeats is None else repeats)
    manifest["sps"] = _profile(Path(engine_dir), manifest, export, options, progress)
    write_engine_manifest(engine_dir, manifest)
    return manifest


def calibrate_engine(
    engine_dir: str | Path,
    data: str | Path,
    *,
    tokenizer: str | Path | None = None,
    prompt_len: int = 32,
    max_new_tokens: int = 64,
    holdout_fraction: float = 0.25,
    progress: Progress = None,
) -> dict[str, Any]:
    """Fit STS on draft rounds over `data`, store it in engine.json and draw calibration.png."""
    from dspark.runtime.model_info import ModelInfo

    engine = load_engine_dir(engine_dir)
    manifest = engine.manifest
    tokenizer = tokenizer or _find_tokenizer(engine)
    sequences = read_sequences(data, tokenizer)
    if not 0.0 <= holdout_fraction < 1.0:
        raise BuildError(f"holdout fraction must lie in [0, 1), got {holdout_fraction}")
    info = ModelInfo.from_manifest(read_manifest(engine.contract_dir))
    if progress:
        progress(f"calibrating on {len(sequences)} sequences")
    cut = len(sequences) - round(holdout_fraction * len(sequences))
    if cut < 1:
        raise BuildError(f"{data}: {len(sequences)} sequence(s) are too few to hold any out; add more data")
    with open_backend(engine) as backend:
        fit_rows = collect_rounds(backend, info, sequences[:cut], prompt_len=prompt_len,
                                  max_new_tokens=max_new_tokens)
        result = fit_sts(*fit_rows)
        if cut < len(sequences):
            result.holdout = evaluate(result, *collect_rounds(backend, info, sequences[cut:], prompt_len=prompt_len,
                                                              max_new_tokens=max_new_tokens))
    reliability_diagram(Path(engine_dir) / DIAGRAM, *fit_rows, result)
    manifest["calibration"] = {**result.to_dict(), "data": str(Path(data).resolve()), "sequences": len(sequences),
                               "fit_sequences": cut, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens,
                               "mean_accepted_drafts": float(np.mean(fit_rows[1])), "diagram": DIAGRAM}
    write_engine_manifest(engine_dir, manifest)
    return manifest


def _find_tokenizer(engine) -> Path | None:
    for folder in (engine.path, Path(engine.manifest["export"]["dir"])):
        if (folder / "tokenizer.json").is_file():
            return folder / "tokenizer.json"
    return None


__all__: Sequence[str] = ("ENGINE_JSON", "BuildOptions", "build_engine", "calibrate_engine", "reprofile")
