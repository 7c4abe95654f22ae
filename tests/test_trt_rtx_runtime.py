"""The TensorRT backend's plumbing, which no GPU here can run, driven through stand-ins for the
flavour's module and cuda-bindings (host memory as "device" memory): every call runs on the
optimization profile of its bucket, outputs come back, the TensorRT-RTX runtime cache is read at
open and written at close, and an engine refuses a GPU it was not built for, or a plan whose
profile count differs from engine.json. What the stand-ins cannot show, real kernels and real
CUDA, waits for an RTX GPU (tests/test_trt_rtx_engine.py)."""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest

from dspark.export import contract as C
from dspark.export.engine_dir import EngineDir
from dspark.runtime.backend import BackendError
from dspark.runtime.trt_backend import TrtBackend
from dspark.runtime.trt_flavours import TensorRTUnavailable

BUCKETS = [1, 8]
SPEC = C.GraphSpec("target", (C.TensorSpec("input_ids", "int64", ("batch", "tokens")),),
                   (C.TensorSpec("logits", "float32", ("batch", "tokens", 3)),))


class FakeContext:
    """Computes logits[b, t, :] = input_ids[b, t] + 100 * profile, in the buffers it was given."""

    def __init__(self, engine):
        self.engine, self.profile, self.addresses, self.shapes = engine, None, {}, {}

    def set_optimization_profile_async(self, k, stream):
        assert isinstance(stream, int)
        self.profile = k
        return True

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)

    def set_tensor_address(self, name, address):
        self.addresses[name] = address

    def get_tensor_shape(self, name):
        return (*self.shapes["input_ids"], 3)

    def execute_async_v3(self, stream):
        shape = self.shapes["input_ids"]
        ids = np.frombuffer((ctypes.c_char * (8 * int(np.prod(shape)))).from_address(self.addresses["input_ids"]),
                            np.int64).reshape(shape)
        out = np.frombuffer((ctypes.c_char * (12 * int(np.prod(shape)))).from_address(self.addresses["logits"]),
                            np.float32).reshape(*shape, 3)
        out[...] = ids[..., None] + 100.0 * self.profile
        self.engine.calls.append(self.profile)
        return True


class FakeCache:
    def __init__(self, log):
        self.log, self.loaded = log, None

    def deserialize(self, blob):
        self.loaded = bytes(blob)
        self.log.append(("loaded", self.loaded))
        return True

    def serialize(self):
        return b"kernels compiled at run time"


class FakeConfig:
    def __init__(self, log):
        self.log, self.cache = log, None

    def create_runtime_cache(self):
        return FakeCache(self.log)

    def set_runtime_cache(self, cache):
        self.cache = cache


class FakeEngine:
    def __init__(self, plan, log):
        self.num_optimization_profiles, self.log, self.calls = int(plan.decode().split()[-1]), log, []
        self.num_io_tensors = 2

    def get_tensor_name(self, i):
        return ("input_ids", "logits")[i]

    def get_tensor_mode(self, name):
        return "out" if name == "logits" else "in"

    def get_tensor_dtype(self, name):
        return np.float32 if name == "logits" else np.int64

    def create_runtime_config(self):
        return FakeConfig(self.log)

    def create_execution_context(self, config=None):
        self.log.append(("context", config is not None and config.cache is not None))
        return FakeContext(self)


def fake_modules(log, cc=(8, 9)):
    trt = types.ModuleType("tensorrt_rtx")
    trt.__version__ = "1.7.1.116"
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    trt.TensorIOMode = types.SimpleNamespace(OUTPUT="out")
    trt.nptype = lambda dtype: dtype
    engines = []

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, plan):
            engines.append(FakeEngine(plan, log))
            return engines[-1]

    trt.Runtime = Runtime
    memory: dict[int, ctypes.Array] = {}
    ok = "ok"

    def malloc(size):
        buffer = ctypes.create_string_buffer(size)
        memory[ctypes.addressof(buffer)] = buffer
        return ok, ctypes.addressof(buffer)

    def memcpy(dst, src, count, kind, stream):
        ctypes.memmove(dst, src, count)
        return (ok,)

    attr = types.SimpleNamespace(cudaDevAttrComputeCapabilityMajor="major", cudaDevAttrComputeCapabilityMinor="minor")
    cudart = types.SimpleNamespace(
        cudaError_t=types.SimpleNamespace(cudaSuccess=ok), cudaGetDeviceCount=lambda: (ok, 1),
        cudaDeviceAttr=attr, cudaDeviceGetAttribute=lambda a, d: (ok, cc[0] if a == "major" else cc[1]),
        cudaStreamCreate=lambda: (ok, 7), cudaMalloc=malloc, cudaFree=lambda p: (memory.pop(p) and (ok,)),
        cudaMemcpyAsync=memcpy, cudaStreamSynchronize=lambda s: (ok,), cudaStreamDestroy=lambda s: (ok,),
        cudaMemcpyKind=types.SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2),
        cudaGetErrorName=lambda e: (ok, str(e).encode()))
    cuda, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    bindings.runtime, cuda.bindings = cudart, bindings
    return {"tensorrt_rtx": trt, "cuda": cuda, "cuda.bindings": bindings, "cuda.bindings.runtime": cudart}, engines


def engine_dir(tmp_path, profiles=2, ccs=("8.0", "8.9")):  # 2 profiles: one per bucket
    plan = f"fake plan with profiles {profiles}".encode()
    (tmp_path / "plans").mkdir(exist_ok=True)
    (tmp_path / "plans" / "target.plan").write_bytes(plan)
    manifest = {"backend": "tensorrt", "buckets": BUCKETS,
                "graphs": {"target": {"file": "plans/target.plan", "bytes": len(plan), "sha256": "0" * 64}},
                "tensorrt": {"flavour": "tensorrt-rtx", "compute_capabilities": list(ccs)}}
    return EngineDir(tmp_path, manifest)


@pytest.fixture
def fakes(monkeypatch):
    log: list = []
    modules, engines = fake_modules(log)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return log, engines


def test_each_call_runs_on_its_buckets_profile_and_returns_its_outputs(tmp_path, fakes):
    _, engines = fakes
    with TrtBackend(engine_dir(tmp_path), {"target": SPEC}) as backend:
        assert backend.flavour.name == "tensorrt-rtx"
        one = backend.run("target", {"input_ids": np.array([[5]], np.int64)})["logits"]
        ids = np.arange(6, dtype=np.int64).reshape(2, 3)  # 6 tokens: bucket 8, profile 1
        six = backend.run("target", {"input_ids": ids})["logits"]
        again = backend.run("target", {"input_ids": np.array([[9]], np.int64)})["logits"]
    assert engines[0].calls == [0, 1, 0]
    np.testing.assert_array_equal(one, np.full((1, 1, 3), 5.0, np.float32))
    np.testing.assert_array_equal(six, ids[..., None].astype(np.float32) + 100.0 + np.zeros((2, 3, 3), np.float32))
    np.testing.assert_array_equal(again, np.full((1, 1, 3), 9.0, np.float32))


def test_the_runtime_cache_is_read_at_open_and_written_at_close(tmp_path, fakes):
    log, _ = fakes
    engine = engine_dir(tmp_path)
    with TrtBackend(engine, {"target": SPEC}):
        pass
    cache = tmp_path / "runtime_cache" / "target.cache"
    assert cache.read_bytes() == b"kernels compiled at run time"
    assert ("context", True) in log and not [e for e in log if e[0] == "loaded"]
    with TrtBackend(engine, {"target": SPEC}):
        pass
    assert ("loaded", b"kernels compiled at run time") in log


def test_a_gpu_the_plans_were_not_built_for_is_refused(tmp_path, fakes):
    with pytest.raises(TensorRTUnavailable, match=r"compute capabilities \['8.0'\], the GPU here is 8.9: rebuild "
                                                  r"with --compute-capabilities 8.9"):
        TrtBackend(engine_dir(tmp_path, ccs=("8.0",)), {"target": SPEC}).open()


def test_a_plan_with_another_profile_count_is_refused(tmp_path, fakes):
    with pytest.raises(BackendError, match="the plan has 1 optimization profiles, engine.json expects 2"):
        TrtBackend(engine_dir(tmp_path, profiles=1), {"target": SPEC}).open()
