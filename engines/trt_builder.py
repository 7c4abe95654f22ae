"""The TensorRT engine: one serialized plan per graph, one optimization profile per token bucket.

Build stages (Polygraphy-style, each small): load TensorRT lazily → load the dspark plugin
library → parse the ONNX graph into a strongly typed network → add one profile per bucket
(buckets.profile_shapes: min/opt/max) → build with the timing cache of the engine dir (read
before, written back after, so rebuilds reuse tactic timings) → compare against ONNX Runtime
with Polygraphy.

TensorRT 10 vs 11: precision always comes from the exported graph. The network is created with
`NetworkDefinitionCreationFlag.STRONGLY_TYPED` (needed on 10.x, accepted and ignored on 11.x,
where every network is strongly typed); no FP16/BF16 builder flags are ever set (they do not
exist on 11.x, and on 10.x they are refused for strongly typed networks). TensorRT < 10 is
refused. `import tensorrt` happens only here, inside functions, so the rest of dspark works
without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dspark.export import contract as C
from dspark.export.artifacts import sha256
from dspark.export.manifest import graph_specs
from dspark.runtime.trt_backend import TARGET_GRAPHS, TensorRTUnavailable, import_tensorrt

from .buckets import ShapeLimits, profile_shapes
from .export_source import BuildError
from .feeds import random_feeds
from .profiling import target_sizes

PLUGIN_LIBRARY = "libdspark_plugins_trt.so"
TIMING_CACHE = "timing.cache"
PLAN_DIR = "plans"


def plugin_library_path() -> Path:
    """DSPARK_PLUGINS_TRT_LIB, else plugins/build/libdspark_plugins_trt.so (plugins/build.sh)."""
    if os.environ.get("DSPARK_PLUGINS_TRT_LIB"):
        return Path(os.environ["DSPARK_PLUGINS_TRT_LIB"])
    build = os.environ.get("DSPARK_PLUGINS_BUILD", Path(__file__).resolve().parents[1] / "plugins" / "build")
    return Path(build) / PLUGIN_LIBRARY


def load_plugins(trt: Any, logger: Any, library: Path) -> str:
    """Register TensorRT's own plugins and the dspark plugin library (before any ONNX parse)."""
    trt.init_libnvinfer_plugins(logger, "")
    if not library.is_file():
        raise BuildError(f"{library} not found: run plugins/build.sh with TensorRT headers "
                         f"(TENSORRT_ROOT) or set DSPARK_PLUGINS_TRT_LIB")
    trt.get_plugin_registry().load_library(str(library))
    return str(library)


def network_flags(trt: Any) -> int:
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def parse_onnx(trt: Any, builder: Any, logger: Any, path: Path) -> Any:
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):  # from the file: external weights resolve beside it
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {path}: {errors}")
    return network, parser


def build_plan(
    trt: Any,
    logger: Any,
    onnx_path: Path,
    profiles: list[Mapping[str, tuple[tuple[int, ...], ...]]],
    timing_cache: Path,
    workspace_bytes: int,
) -> bytes:
    """Serialized engine for `onnx_path` with one optimization profile per entry of `profiles`."""
    builder = trt.Builder(logger)
    network, _parser = parse_onnx(trt, builder, logger, onnx_path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    for shapes in profiles:
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(f"TensorRT failed to build {onnx_path} (see the TensorRT log above)")
    timing_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    return bytes(plan)


def graph_profiles(spec: C.GraphSpec, buckets: tuple[int, ...], limits: ShapeLimits) -> list[dict]:
    """Target graphs: one profile per bucket; drafter graphs: one profile (the largest bucket)."""
    chosen = buckets if spec.name in TARGET_GRAPHS else buckets[-1:]
    return [profile_shapes(spec, b, limits) for b in chosen]


def compare_with_ort(plan: bytes, onnx_path: Path, spec: C.GraphSpec, feeds: list[dict[str, np.ndarray]],
                     profile: int, atol: float, rtol: float) -> dict[str, Any]:
    """Polygraphy: run TensorRT (profile `profile`) and ONNX Runtime on the same feeds, compare outputs."""
    try:
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner
        from polygraphy.comparator import Comparator, CompareFunc
    except ImportError:
        raise TensorRTUnavailable('Polygraphy is not installed: pip install "dspark[tensorrt]"') from None
    runners = [TrtRunner(EngineFromBytes(plan), optimization_profile=profile),
               OnnxrtRunner(SessionFromOnnx(str(onnx_path)))]
    results = Comparator.run(runners, data_loader=feeds)
    passed = bool(Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=atol, rtol=rtol)))
    return {"graph": spec.name, "profile": profile, "atol": atol, "rtol": rtol, "passed": passed,
            "feeds": len(feeds)}


def build_trt(
    export_dir: Path,
    export_manifest: dict[str, Any],
    out_dir: Path,
    *,
    buckets: tuple[int, ...],
    limits: ShapeLimits,
    workspace_bytes: int = 4 << 30,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Plans for every graph into out_dir/plans -> (engine.json `graphs`, engine.json `tensorrt`)."""
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    library = load_plugins(trt, logger, plugin_library_path())
    (out_dir / PLAN_DIR).mkdir(parents=True, exist_ok=True)
    cache = out_dir / TIMING_CACHE
    vocab = export_manifest["target"]["vocab_size"]
    graphs, profiles, comparisons = {}, {}, []
    specs = graph_specs(export_manifest)
    for name, entry in export_manifest["graphs"].items():
        if entry.get("flavour", "plain") != "plain":
            continue  # the fused flavour is made of ONNX Runtime contrib ops, which TensorRT cannot parse
        spec = specs[name]
        onnx_path = export_dir / entry["file"]
        shapes = graph_profiles(spec, buckets, limits)
        if progress:
            progress(f"building {name}: {len(shapes)} profile(s)")
        plan = build_plan(trt, logger, onnx_path, shapes, cache, workspace_bytes)
        path = out_dir / PLAN_DIR / f"{name}.plan"
        path.write_bytes(plan)
        graphs[name] = {"file": f"{PLAN_DIR}/{path.name}", "bytes": path.stat().st_size, "sha256": sha256(path),
                        "source": entry["file"]}
        profiles[name] = [{"bucket": b, "shapes": {k: [list(s) for s in v] for k, v in p.items()}}
                          for b, p in zip(buckets if name in TARGET_GRAPHS else buckets[-1:], shapes, strict=True)]
        if name in TARGET_GRAPHS:
            for k in sorted({0, len(buckets) - 1}):
                opt = {d: shapes[k][t.name][1][i] for t in spec.inputs for i, d in enumerate(t.dims)
                       if isinstance(d, str)}
                sizes = target_sizes(name, opt["batch"], opt["tokens"], opt.get("past", opt.get("capacity", 0)))
                feeds = [random_feeds(spec, sizes, vocab_size=vocab, seed=s) for s in range(2)]
                comparisons.append(compare_with_ort(plan, onnx_path, spec, feeds, k, atol, rtol))
    failed = [c for c in comparisons if not c["passed"]]
    if failed:
        raise BuildError(f"TensorRT outputs differ from ONNX Runtime beyond atol={atol}, rtol={rtol}: {failed}")
    section = {"version": trt.__version__, "strongly_typed": True, "plugin_library": library,
               "timing_cache": TIMING_CACHE, "profiles": profiles, "comparison": comparisons}
    return graphs, section
