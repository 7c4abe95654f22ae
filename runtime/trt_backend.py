"""The TensorRT backend: an engine directory's serialized plans, run by graph name, for both
TensorRT flavours (runtime/trt_flavours.py; engine.json `tensorrt.flavour`, absent = tensorrt).

Each target plan holds one optimization profile per token bucket (engine.json `buckets`); a call
[R, T] runs on the profile of the smallest bucket holding R·T tokens. The drafter plans have one
profile. A plan runs on the flavour's own API (Runtime → ICudaEngine → one IExecutionContext per
profile) with device buffers from cuda-bindings: host arrays in, host arrays out. A TensorRT-RTX
plan's contexts share one runtime cache (the kernels it JIT-compiles on the GPU), read from the
engine dir (runtime_cache/<graph>.cache) at open and written back at close. The flavour's module
and cuda-bindings are imported in `open()` only, so this module imports anywhere; without them, or
without a GPU, opening raises BackendUnavailable with one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dspark.export import contract as C
from dspark.export.artifacts import check_size
from dspark.export.engine_dir import REBUILD, EngineDir
from dspark.export.manifest import graph_specs, read_manifest

from .backend import Array, Backend, BackendError
from .trt_flavours import TENSORRT, TensorRTUnavailable, TrtFlavour, flavour_named, import_flavour

TARGET_GRAPHS = (C.TARGET, C.TARGET_STATIC)


def engine_flavour(engine: EngineDir) -> TrtFlavour:
    return flavour_named(engine.manifest.get("tensorrt", {}).get("flavour", TENSORRT.name))


def import_cudart(flavour: TrtFlavour) -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise TensorRTUnavailable(f'cuda-bindings is not installed: pip install "dspark[{flavour.extra}]"') from None
    return cudart


def device_cc(cudart: Any, device: int = 0) -> str:
    """'8.9' for an RTX 4090."""
    attribute = cudart.cudaDeviceAttr
    major = cudart.cudaDeviceGetAttribute(attribute.cudaDevAttrComputeCapabilityMajor, device)[1]
    minor = cudart.cudaDeviceGetAttribute(attribute.cudaDevAttrComputeCapabilityMinor, device)[1]
    return f"{major}.{minor}"


class PlanRunner:
    """One deserialized plan on one CUDA stream: an execution context per optimization profile and
    device buffers per tensor that grow to the largest call seen."""

    def __init__(self, trt: Any, cudart: Any, runtime: Any, plan: bytes, profiles: int, where: Path,
                 cache_path: Path | None) -> None:
        self._trt, self._cudart = trt, cudart
        self.engine = runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise BackendError(f"{where}: TensorRT could not load this plan (see its log above; a plan runs only on "
                               f"the GPUs and TensorRT version it was built for): {REBUILD}")
        if self.engine.num_optimization_profiles != profiles:
            raise BackendError(f"{where}: the plan has {self.engine.num_optimization_profiles} optimization "
                               f"profiles, engine.json expects {profiles}: {REBUILD}")
        self._stream = self._cuda(cudart.cudaStreamCreate())
        self._stream_handle = int(self._stream)  # TensorRT takes the stream as an integer handle
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self._outputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self._cache_path, self._cache = cache_path, None
        config = self._config = None  # kept: the contexts use it
        if cache_path is not None:
            config = self._config = self.engine.create_runtime_config()
            self._cache = config.create_runtime_cache()
            if cache_path.is_file():  # TensorRT-RTX refuses a file from another GPU or driver: it is rebuilt
                self._cache.deserialize(cache_path.read_bytes())
            config.set_runtime_cache(self._cache)
        self._contexts = []
        for k in range(profiles):
            context = self.engine.create_execution_context() if config is None else \
                self.engine.create_execution_context(config)
            context.set_optimization_profile_async(k, self._stream_handle)
            self._contexts.append(context)
        self._buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes)

    def _cuda(self, result: tuple) -> Any:
        """cuda-bindings calls return (error, value...): the value, or BackendError naming the error."""
        error, *values = result
        if error != self._cudart.cudaError_t.cudaSuccess:
            raise BackendError(f"CUDA call failed: {self._cudart.cudaGetErrorName(error)[1].decode()}")
        return values[0] if len(values) == 1 else None

    def _buffer(self, name: str, nbytes: int) -> int:
        pointer, size = self._buffers.get(name, (0, 0))
        if size < nbytes:
            if pointer:
                self._cuda(self._cudart.cudaFree(pointer))
            size = max(nbytes, 2 * size, 256)  # empty tensors (past 0) still need a valid address
            pointer = int(self._cuda(self._cudart.cudaMalloc(size)))
            self._buffers[name] = (pointer, size)
        return pointer

    def infer(self, feeds: Mapping[str, np.ndarray], profile: int) -> dict[str, np.ndarray]:
        cudart, context = self._cudart, self._contexts[profile]
        for name, value in feeds.items():
            pointer = self._buffer(name, value.nbytes)
            context.set_input_shape(name, value.shape)
            context.set_tensor_address(name, pointer)
            self._cuda(cudart.cudaMemcpyAsync(pointer, value.ctypes.data, value.nbytes,
                                              cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self._stream))
        results = {}
        for name in self._outputs:
            out = np.empty(tuple(context.get_tensor_shape(name)), self._trt.nptype(self.engine.get_tensor_dtype(name)))
            context.set_tensor_address(name, self._buffer(name, out.nbytes))
            results[name] = out
        if not context.execute_async_v3(self._stream_handle):
            raise BackendError("TensorRT could not enqueue the plan (see its log above)")
        for name, out in results.items():
            self._cuda(cudart.cudaMemcpyAsync(out.ctypes.data, self._buffers[name][0], out.nbytes,
                                              cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self._stream))
        self._cuda(cudart.cudaStreamSynchronize(self._stream))
        return results

    def close(self) -> None:
        """Free the buffers; keep the runtime cache's kernels for the next open (best effort: a
        read-only engine dir only loses the cache)."""
        if self._cache is not None and self._cache_path is not None:
            try:
                self._cache_path.parent.mkdir(exist_ok=True)
                self._cache_path.write_bytes(memoryview(self._cache.serialize()))
            except OSError:
                pass
        for pointer, _ in self._buffers.values():
            self._cudart.cudaFree(pointer)
        self._buffers.clear()
        self._contexts.clear()  # contexts before their engine
        self._config = self._cache = self.engine = None
        self._cudart.cudaStreamDestroy(self._stream)


class TrtBackend(Backend):
    def __init__(self, engine: EngineDir, specs: Mapping[str, C.GraphSpec]) -> None:
        super().__init__()
        self.engine = engine
        self.flavour = engine_flavour(engine)
        self._specs = {name: specs[name] for name in engine.manifest["graphs"]}
        self._runners: dict[str, PlanRunner] = {}
        self._runtime: Any | None = None  # TensorRT's runtime must outlive the engines it deserialized

    @classmethod
    def for_engine(cls, engine: EngineDir) -> TrtBackend:
        """Specs from the source export's export.json (engine.json `export.dir`)."""
        return cls(engine, graph_specs(read_manifest(engine.contract_dir, verify="none")))

    @property
    def specs(self) -> dict[str, C.GraphSpec]:
        return self._specs

    def _cache_path(self, graph: str) -> Path | None:
        folder = self.flavour.runtime_cache
        return None if folder is None else self.engine.path / folder / f"{graph}.cache"

    def _open(self) -> None:
        trt = import_flavour(self.flavour)
        cudart = import_cudart(self.flavour)
        error, count = cudart.cudaGetDeviceCount()
        if error != cudart.cudaError_t.cudaSuccess or count == 0:
            ok = error == cudart.cudaError_t.cudaSuccess
            reason = "no device" if ok else cudart.cudaGetErrorName(error)[1].decode()
            raise TensorRTUnavailable(f"{self.flavour.title} engines need an NVIDIA GPU with its driver; CUDA says "
                                      f"{reason} here (build here, serve on the GPU machine)")
        built_for = self.engine.manifest.get("tensorrt", {}).get("compute_capabilities") or []
        here = device_cc(cudart)
        if built_for and here not in built_for:
            raise TensorRTUnavailable(f"this engine's plans run on compute capabilities {built_for}, the GPU here is "
                                      f"{here}: rebuild with --compute-capabilities {here}")
        logger = trt.Logger(trt.Logger.WARNING)
        library = self.engine.manifest.get("tensorrt", {}).get("plugin_library")
        if library and self.flavour.plugin_library:
            trt.init_libnvinfer_plugins(logger, "")
            trt.get_plugin_registry().load_library(library)
        runtime = self._runtime = trt.Runtime(logger)
        for name, entry in self.engine.manifest["graphs"].items():
            path = self.engine.graph_path(name)
            check_size(path, entry["bytes"], REBUILD)
            profiles = len(self.engine.buckets) if name in TARGET_GRAPHS else 1
            self._runners[name] = PlanRunner(trt, cudart, runtime, path.read_bytes(), profiles, path,
                                             self._cache_path(name))

    def _close(self) -> None:
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()
        self._runtime = None

    def profile_for(self, graph: str, feeds: Mapping[str, Array]) -> int:
        """The optimization profile a call runs on: its bucket for target graphs, else 0."""
        if graph not in TARGET_GRAPHS:
            return 0
        batch, tokens = feeds["input_ids"].shape
        return self.engine.bucket_for(batch * tokens)

    def _run(self, graph: str, feeds: Mapping[str, Array]) -> dict[str, Array]:
        host = {name: np.ascontiguousarray(value) for name, value in feeds.items()}
        return self._runners[graph].infer(host, self.profile_for(graph, feeds))
