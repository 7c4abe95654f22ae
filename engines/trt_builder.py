"""The TensorRT engine, for both flavours (TensorRT, TensorRT-RTX): one serialized plan per graph,
one optimization profile per verification bucket.

Build stages, each small: import the flavour's module (runtime/trt_flavours.py says what differs)
→ load the dspark plugin library (full TensorRT only) → parse the ONNX graph into a strongly typed
network → add one profile per bucket (buckets.profile_shapes, the table the ONNX Runtime engines
use) → target compute capabilities (TensorRT-RTX: chosen, built ahead of time without a GPU; full
TensorRT: the GPU it runs on) → build, with the timing cache of the engine dir where the flavour
has one → check the network and the profiles TensorRT holds against the graph contract and the
buckets (trt_contract.py) → full TensorRT only: compare against ONNX Runtime with Polygraphy.

Every TensorRT error message of a failed parse or build is in the BuildError raised, so a test or a
user sees TensorRT's own words. Precision always comes from the exported graph: the network is
created STRONGLY_TYPED and no FP16/BF16 builder flag is ever set. `import tensorrt` /
`import tensorrt_rtx` happens only inside functions, so the rest of dspark works without them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dspark.export import contract as C
from dspark.export.artifacts import sha256
from dspark.export.manifest import graph_specs
from dspark.runtime.trt_flavours import TensorRTUnavailable, TrtFlavour, import_flavour

from .buckets import ShapeLimits, profile_shapes
from .export_source import BuildError
from .feeds import random_feeds
from .profiling import target_sizes
from .trt_contract import TARGET_GRAPHS, check_network, check_profiles, network_io, read_profiles

PLUGIN_LIBRARY = "libdspark_plugins_trt.so"
PLAN_DIR = "plans"
Profiles = Sequence[Mapping[str, tuple[tuple[int, ...], ...]]]


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


def check_ccs(flavour: TrtFlavour, ccs: Sequence[str]) -> tuple[str, ...]:
    """The compute capabilities to build for ('8.0', '8.9'), in the flavour's order; () = this GPU."""
    if not flavour.selectable_ccs:
        if ccs:
            raise BuildError(f"{flavour.title} builds for the GPU it runs on; --compute-capabilities is for "
                             f"--backend tensorrt-rtx")
        return ()
    chosen = tuple(ccs) or flavour.default_ccs
    unknown = [cc for cc in chosen if cc not in flavour.selectable_ccs]
    if unknown:
        raise BuildError(f"--compute-capabilities {','.join(unknown)}: {flavour.title} builds for "
                         f"{','.join(flavour.selectable_ccs)}")
    return tuple(sorted(set(chosen), key=flavour.selectable_ccs.index))


def local_ccs() -> list[str]:
    """Compute capabilities of the visible GPUs (what a full TensorRT build targets); [] when NVML
    (nvidia-ml-py, in the tensorrt extra) cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no package, no driver: the build itself will say what is missing
        return []
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return sorted({"{}.{}".format(*pynvml.nvmlDeviceGetCudaComputeCapability(h)) for h in handles})
    finally:
        pynvml.nvmlShutdown()


def make_logger(trt: Any) -> Any:
    """A TensorRT logger that keeps every error message (for BuildError) and drops the rest."""

    class ErrorLog(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.ERROR, trt.ILogger.INTERNAL_ERROR):
                self.errors.append(msg.strip())

    return ErrorLog()


def _said(logger: Any) -> str:
    return " | ".join(logger.errors[-6:]) or "no message"


def network_flags(trt: Any) -> int:
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def parse_onnx(trt: Any, builder: Any, logger: Any, path: Path) -> tuple[Any, Any]:
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):  # from the file: external weights resolve beside it
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT could not parse {path}: {errors}")
    return network, parser


def build_plan(trt: Any, logger: Any, flavour: TrtFlavour, onnx_path: Path, profiles: Profiles, *,
               ccs: Sequence[str] = (), timing_cache: Path | None = None,
               workspace_bytes: int = 4 << 30) -> tuple[bytes, dict[str, Any]]:
    """Serialized plan for `onnx_path` with one optimization profile per entry of `profiles`
    -> (plan, {"network": network_io, "profiles": the profiles as TensorRT holds them})."""
    logger.errors.clear()
    builder = trt.Builder(logger)
    network, _parser = parse_onnx(trt, builder, logger, onnx_path)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if ccs:
        config.num_compute_capabilities = len(ccs)
        for i, cc in enumerate(ccs):
            config.set_compute_capability(getattr(trt.ComputeCapability, "SM" + cc.replace(".", "")), i)
    if timing_cache is not None:
        cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    added = []
    for shapes in profiles:
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        if config.add_optimization_profile(profile) < 0:
            raise BuildError(f"TensorRT refused optimization profile {len(added)} of {onnx_path}: {_said(logger)}")
        added.append(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BuildError(f"{flavour.title} could not build {onnx_path}: {_said(logger)}")
    if timing_cache is not None:
        timing_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    io = network_io(network)
    return bytes(plan), {"network": io, "profiles": read_profiles(added, [t["name"] for t in io["inputs"]])}


def graph_buckets(name: str, buckets: Sequence[int]) -> list[int]:
    """Target graphs: one profile per bucket; drafter graphs: one (the largest bucket)."""
    return list(buckets) if name in TARGET_GRAPHS else [buckets[-1]]


def graph_profiles(spec: C.GraphSpec, buckets: Sequence[int], limits: ShapeLimits) -> list[dict]:
    return [profile_shapes(spec, b, limits) for b in graph_buckets(spec.name, buckets)]


def compare_with_ort(plan: bytes, onnx_path: Path, spec: C.GraphSpec, feeds: list[dict[str, np.ndarray]],
                     profile: int, atol: float, rtol: float) -> dict[str, Any]:
    """Polygraphy (full TensorRT only): run TensorRT (profile `profile`) and ONNX Runtime on the
    same feeds, compare outputs."""
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


def buildable_graphs(export_manifest: Mapping[str, Any]) -> list[str]:
    """The graphs TensorRT builds: the plain flavour (the fused flavour is made of ONNX Runtime
    contrib ops, GroupQueryAttention among them, which TensorRT's parser cannot import)."""
    return [name for name, entry in export_manifest["graphs"].items() if entry.get("flavour", "plain") == "plain"]


def build_trt(
    export_dir: Path,
    export_manifest: dict[str, Any],
    out_dir: Path,
    *,
    flavour: TrtFlavour,
    buckets: tuple[int, ...],
    limits: ShapeLimits,
    compute_capabilities: Sequence[str] = (),
    workspace_bytes: int = 4 << 30,
    atol: float = 1e-3,
    rtol: float = 1e-3,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Plans for every buildable graph into out_dir/plans -> (engine.json `graphs`, engine.json `tensorrt`)."""
    trt = import_flavour(flavour)
    ccs = check_ccs(flavour, compute_capabilities)
    logger = make_logger(trt)
    library = load_plugins(trt, logger, plugin_library_path()) if flavour.plugin_library else None
    (out_dir / PLAN_DIR).mkdir(parents=True, exist_ok=True)
    timing_cache = out_dir / flavour.timing_cache if flavour.timing_cache else None
    vocab = export_manifest["target"]["vocab_size"]
    graphs, profiles, seconds, comparisons = {}, {}, {}, []
    specs = graph_specs(export_manifest)
    for name in buildable_graphs(export_manifest):
        spec, entry = specs[name], export_manifest["graphs"][name]
        onnx_path = export_dir / entry["file"]
        shapes = graph_profiles(spec, buckets, limits)
        if progress:
            progress(f"building {name} ({flavour.name}): {len(shapes)} profile(s)")
        begin = time.perf_counter()
        plan, held = build_plan(trt, logger, flavour, onnx_path, shapes, ccs=ccs, timing_cache=timing_cache,
                                workspace_bytes=workspace_bytes)
        seconds[name] = round(time.perf_counter() - begin, 3)
        check_network(spec, held["network"])
        check_profiles(spec, held["profiles"], buckets, limits)
        path = out_dir / PLAN_DIR / f"{name}.plan"
        path.write_bytes(plan)
        graphs[name] = {"file": f"{PLAN_DIR}/{path.name}", "bytes": path.stat().st_size, "sha256": sha256(path),
                        "source": entry["file"]}
        profiles[name] = [{"bucket": b, "shapes": p} for b, p in zip(graph_buckets(name, buckets), held["profiles"],
                                                                     strict=True)]
        if name in TARGET_GRAPHS and not flavour.ahead_of_time:
            for k in sorted({0, len(buckets) - 1}):
                opt = {d: shapes[k][t.name][1][i] for t in spec.inputs for i, d in enumerate(t.dims)
                       if isinstance(d, str)}
                sizes = target_sizes(name, opt["batch"], opt["tokens"], opt.get("past", opt.get("capacity", 0)))
                feeds = [random_feeds(spec, sizes, vocab_size=vocab, seed=s) for s in range(2)]
                comparisons.append(compare_with_ort(plan, onnx_path, spec, feeds, k, atol, rtol))
    failed = [c for c in comparisons if not c["passed"]]
    if failed:
        raise BuildError(f"TensorRT outputs differ from ONNX Runtime beyond atol={atol}, rtol={rtol}: {failed}")
    section = {
        "flavour": flavour.name, "version": trt.__version__,
        "compute_capabilities": list(ccs) if ccs else local_ccs(),
        "ahead_of_time": flavour.ahead_of_time, "strongly_typed": True, "plugin_library": library,
        "timing_cache": flavour.timing_cache, "runtime_cache": flavour.runtime_cache,
        "profiles": profiles, "build_seconds": seconds,
        # ahead of time there is no GPU to run the plans on: null says "not compared", not "passed"
        "comparison": None if flavour.ahead_of_time else comparisons,
        "skipped": {name: "fused flavour: ONNX Runtime contrib ops" for name in export_manifest["graphs"]
                    if name not in graphs},
    }
    return graphs, section
