"""ctypes bindings of the compiled CUDA launchers (libdspark_plugins_cuda.so, built by build.sh).

`run_*` take and return host numpy arrays: they copy the inputs to the GPU, launch, synchronise and
copy the outputs back. They exist to check the kernels against the numpy references and to debug.
`on_device_*` launch the same kernels on CUDA tensors, on torch's current stream, with nothing
copied: what `dspark.plugins`' API calls when its inputs live on a GPU (the batched engine's tree
verification there), as the TensorRT plugin calls them on its device buffers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from functools import cache
from pathlib import Path

import numpy as np
import torch

from .tree_accept.reference import TreeAcceptResult

BUILD_DIR = Path(os.environ.get("DSPARK_PLUGINS_BUILD", Path(__file__).resolve().parent / "build"))
LIBRARY_NAME = "libdspark_plugins_cuda.so"
_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost

_p, _i32, _sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_size_t
_SIGNATURES = {
    "dspark_tree_attention_mask": [_p, _p, _i32, _i32, _p, _p, _p, _p],
    "dspark_tree_attention_mask_i32": [_p, _p, _i32, _i32, _p, _p, _p, _p],
    "dspark_tree_accept_greedy": [_p, _p, _p, _p, _i32, _i32, _i32, _p, _p, _p, _p, _p],
    "dspark_tree_accept_sampling_workspace_size": [_i32, _i32],
    "dspark_tree_accept_sampling": [_p, _p, _p, _p, _p, _p, _i32, _i32, _i32, _i32, _p, _p, _p, _p, _p, _p],
}


class CudaUnavailableError(RuntimeError):
    """The CUDA runtime, a GPU, or the compiled plugin library is missing."""


def library_path() -> Path:
    return Path(os.environ.get("DSPARK_PLUGINS_LIB", BUILD_DIR / LIBRARY_NAME))


def plugin_library() -> ctypes.CDLL:
    """The compiled launchers at library_path() (DSPARK_PLUGINS_LIB or plugins/build)."""
    return _load_plugin_library(library_path().resolve())


@cache
def _load_plugin_library(path: Path) -> ctypes.CDLL:
    if not path.is_file():
        raise CudaUnavailableError(f"{path} not found: run plugins/build.sh (or set DSPARK_PLUGINS_LIB)")
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _sz if name.endswith("workspace_size") else ctypes.c_int
    return lib


def _cudart_candidates() -> list[str]:
    found = ctypes.util.find_library("cudart")
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    globs = [g for r in roots if r for g in sorted(glob.glob(f"{r}/lib64/libcudart.so*"))]
    return [c for c in [found, *globs] if c]


@cache
def cudart() -> ctypes.CDLL:
    """The CUDA runtime library, with at least one visible GPU."""
    for candidate in _cudart_candidates():
        try:
            lib = ctypes.CDLL(candidate)
            break
        except OSError:
            continue
    else:
        raise CudaUnavailableError("libcudart.so not found (no CUDA toolkit under CUDA_HOME or /usr/local/cuda)")
    lib.cudaMalloc.argtypes = [ctypes.POINTER(_p), _sz]
    lib.cudaFree.argtypes = [_p]
    lib.cudaMemcpy.argtypes = [_p, _p, _sz, ctypes.c_int]
    lib.cudaMemset.argtypes = [_p, ctypes.c_int, _sz]
    lib.cudaGetErrorString.restype = ctypes.c_char_p
    count = ctypes.c_int(0)
    if lib.cudaGetDeviceCount(ctypes.byref(count)) != 0 or count.value == 0:
        raise CudaUnavailableError("no CUDA GPU visible (cudaGetDeviceCount found none)")
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: CUDA error {status} ({cudart().cudaGetErrorString(status).decode()})")


class _Device:
    """Device buffers for one call, freed on exit."""

    def __init__(self) -> None:
        self.buffers: list[ctypes.c_void_p] = []

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        for ptr in self.buffers:
            cudart().cudaFree(ptr)

    def alloc(self, nbytes: int) -> ctypes.c_void_p:
        ptr = ctypes.c_void_p()
        _check(cudart().cudaMalloc(ctypes.byref(ptr), max(nbytes, 1)), "cudaMalloc")
        _check(cudart().cudaMemset(ptr, 0x7F, max(nbytes, 1)), "cudaMemset")  # poison: outputs must be written
        self.buffers.append(ptr)
        return ptr

    def put(self, array: np.ndarray) -> ctypes.c_void_p:
        array = np.ascontiguousarray(array)
        ptr = self.alloc(array.nbytes)
        _check(cudart().cudaMemcpy(ptr, array.ctypes.data, array.nbytes, _H2D), "cudaMemcpy to device")
        return ptr

    @staticmethod
    def get(ptr: ctypes.c_void_p, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        _check(cudart().cudaMemcpy(out.ctypes.data, ptr, out.nbytes, _D2H), "cudaMemcpy to host")
        return out


def run_tree_attention_mask(
    parents: np.ndarray, past_lengths: np.ndarray, *, int32_mask: bool = False
) -> tuple[np.ndarray, ...]:
    """parents [batch, N], past_lengths [batch] -> (mask [batch,1,N,N] bool, position_ids, packed_mask).

    int32_mask runs the launcher the TensorRT plugin uses (mask written as int32 0/1).
    """
    batch, n = parents.shape
    words = -(-n // 32)
    lib = plugin_library()
    launch = lib.dspark_tree_attention_mask_i32 if int32_mask else lib.dspark_tree_attention_mask
    mask_type = np.int32 if int32_mask else np.uint8
    with _Device() as dev:
        mask = dev.alloc(batch * n * n * np.dtype(mask_type).itemsize)
        pos, packed = dev.alloc(batch * n * 8), dev.alloc(batch * n * words * 4)
        ins = [dev.put(parents.astype(np.int64)), dev.put(past_lengths.astype(np.int64))]
        _check(launch(*ins, batch, n, mask, pos, packed, None), "dspark_tree_attention_mask")
        _check(cudart().cudaDeviceSynchronize(), "dspark_tree_attention_mask kernel")
        return (
            _as_bool(dev.get(mask, (batch, 1, n, n), mask_type)),
            dev.get(pos, (batch, n), np.int64),
            dev.get(packed, (batch, n, words), np.int32),
        )


def _as_bool(mask: np.ndarray) -> np.ndarray:
    if not np.isin(mask, (0, 1)).all():
        raise RuntimeError("the mask kernel wrote values other than 0 and 1")
    return mask.astype(bool)


def _accept_outputs(dev: _Device, batch: int, max_depth: int) -> list[ctypes.c_void_p]:
    width = max_depth + 1
    return [
        dev.alloc(batch * width * 8),
        dev.alloc(batch * 8),
        dev.alloc(batch * 8),
        dev.alloc(batch * width * 8),
    ]


def _accept_result(dev: _Device, outs: list[ctypes.c_void_p], batch: int, max_depth: int) -> TreeAcceptResult:
    width = max_depth + 1
    return TreeAcceptResult(
        accepted_path=dev.get(outs[0], (batch, width), np.int64),
        accept_length=dev.get(outs[1], (batch,), np.int64),
        bonus_token=dev.get(outs[2], (batch,), np.int64),
        kv_keep=dev.get(outs[3], (batch, width), np.int64),
    )


def run_tree_accept_greedy(
    parents: np.ndarray,
    draft_tokens: np.ndarray,
    past_lengths: np.ndarray,
    target_tokens: np.ndarray,
    max_depth: int,
) -> TreeAcceptResult:
    batch, n = parents.shape
    lib = plugin_library()
    with _Device() as dev:
        ins = [dev.put(a.astype(np.int64)) for a in (parents, draft_tokens, past_lengths, target_tokens)]
        outs = _accept_outputs(dev, batch, max_depth)
        _check(lib.dspark_tree_accept_greedy(*ins, batch, n, max_depth, *outs, None), "dspark_tree_accept_greedy")
        _check(cudart().cudaDeviceSynchronize(), "dspark_tree_accept_greedy kernel")
        return _accept_result(dev, outs, batch, max_depth)


def run_tree_accept_sampling(
    parents: np.ndarray,
    draft_tokens: np.ndarray,
    past_lengths: np.ndarray,
    target_probs: np.ndarray,
    draft_probs: np.ndarray,
    uniforms: np.ndarray,
    max_depth: int,
) -> TreeAcceptResult:
    batch, n, vocab = target_probs.shape
    lib = plugin_library()
    with _Device() as dev:
        ints = [dev.put(a.astype(np.int64)) for a in (parents, draft_tokens, past_lengths)]
        floats = [dev.put(a.astype(np.float32)) for a in (target_probs, draft_probs, uniforms)]
        workspace = dev.alloc(lib.dspark_tree_accept_sampling_workspace_size(batch, vocab))
        outs = _accept_outputs(dev, batch, max_depth)
        status = lib.dspark_tree_accept_sampling(*ints, *floats, batch, n, vocab, max_depth, workspace, *outs, None)
        _check(status, "dspark_tree_accept_sampling")
        _check(cudart().cudaDeviceSynchronize(), "dspark_tree_accept_sampling kernel")
        return _accept_result(dev, outs, batch, max_depth)


def on_device_available(tensor: object) -> bool:
    """True when `tensor` is a CUDA tensor and the compiled launchers are there to run on it."""
    return isinstance(tensor, torch.Tensor) and tensor.is_cuda and library_path().is_file()


def _ptr(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())


def _stream(device: torch.device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


def on_device_tree_attention_mask(parents: torch.Tensor,
                                  past_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TreeAttentionMask on CUDA tensors -> (mask [batch,1,N,N] bool, position_ids, packed_mask), same device."""
    batch, n = parents.shape
    device = parents.device
    parents, past = (t.to(device=device, dtype=torch.int64).contiguous() for t in (parents, past_lengths))
    mask = torch.empty((batch, 1, n, n), dtype=torch.uint8, device=device)
    positions = torch.empty((batch, n), dtype=torch.int64, device=device)
    packed = torch.empty((batch, n, -(-n // 32)), dtype=torch.int32, device=device)
    status = plugin_library().dspark_tree_attention_mask(_ptr(parents), _ptr(past), batch, n, _ptr(mask),
                                                         _ptr(positions), _ptr(packed), _stream(device))
    _check(status, "dspark_tree_attention_mask")
    return mask.view(torch.bool), positions, packed


def on_device_tree_accept_greedy(parents: torch.Tensor, draft_tokens: torch.Tensor, past_lengths: torch.Tensor,
                                 target_tokens: torch.Tensor, max_depth: int) -> TreeAcceptResult:
    """Greedy TreeAccept on `target_tokens`' GPU (the other inputs are moved there); the result's arrays are
    tensors on that device."""
    batch, n = parents.shape
    device = target_tokens.device
    ins = [t.to(device=device, dtype=torch.int64).contiguous()
           for t in (parents, draft_tokens, past_lengths, target_tokens)]
    width = max_depth + 1
    outs = [torch.empty(shape, dtype=torch.int64, device=device)
            for shape in ((batch, width), (batch,), (batch,), (batch, width))]
    status = plugin_library().dspark_tree_accept_greedy(*map(_ptr, ins), batch, n, max_depth, *map(_ptr, outs),
                                                        _stream(device))
    _check(status, "dspark_tree_accept_greedy")
    return TreeAcceptResult(*outs)


def on_device_tree_accept_sampling(parents: torch.Tensor, draft_tokens: torch.Tensor, past_lengths: torch.Tensor,
                                   target_probs: torch.Tensor, draft_probs: torch.Tensor, uniforms: torch.Tensor,
                                   max_depth: int) -> TreeAcceptResult:
    """Sampling TreeAccept on `target_probs`' GPU (float32 probabilities and uniforms, as the kernel reads
    them; the other inputs are moved there); the result's arrays are tensors on that device."""
    batch, n, vocab = target_probs.shape
    device = target_probs.device
    ints = [t.to(device=device, dtype=torch.int64).contiguous() for t in (parents, draft_tokens, past_lengths)]
    floats = [t.to(device=device, dtype=torch.float32).contiguous() for t in (target_probs, draft_probs, uniforms)]
    lib = plugin_library()
    workspace = torch.empty(max(int(lib.dspark_tree_accept_sampling_workspace_size(batch, vocab)), 1),
                            dtype=torch.uint8, device=device)
    width = max_depth + 1
    outs = [torch.empty(shape, dtype=torch.int64, device=device)
            for shape in ((batch, width), (batch,), (batch,), (batch, width))]
    status = lib.dspark_tree_accept_sampling(*map(_ptr, ints), *map(_ptr, floats), batch, n, vocab, max_depth,
                                             _ptr(workspace), *map(_ptr, outs), _stream(device))
    _check(status, "dspark_tree_accept_sampling")
    return TreeAcceptResult(*outs)
