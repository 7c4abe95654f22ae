"""CUDA plugin kernels: the build script compiles them (needs nvcc); on a GPU they match the references."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from test_plugins_reference import random_trees

from dspark.plugins import child_draft_probs, cuda
from dspark.plugins.tree_accept.reference import tree_accept_greedy, tree_accept_sampling
from dspark.plugins.tree_attention_mask.reference import tree_attention_mask

BUILD_SCRIPT = Path(cuda.__file__).resolve().parent / "build.sh"
CUDA_INVALID_VALUE = 1


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or next((p for p in ["/usr/local/cuda/bin/nvcc"] if os.access(p, os.X_OK)), None)


def build(out_dir: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    env = {**os.environ, "DSPARK_PLUGINS_BUILD": str(out_dir)}
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    return proc, time.perf_counter() - start


def test_build_script_compiles_the_cuda_kernels(tmp_path):
    if find_nvcc() is None:
        pytest.skip("nvcc not found (no CUDA toolkit on PATH or in /usr/local/cuda): cannot compile the kernels")
    proc, seconds = build(tmp_path)
    print(f"plugins/build.sh took {seconds:.1f} s\n{proc.stdout[-2000:]}")
    assert proc.returncode == 0, f"build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert "TensorRT headers" in proc.stdout  # says whether the TensorRT plugin library was built or skipped
    lib = ctypes.CDLL(str(tmp_path / cuda.LIBRARY_NAME))  # statically linked cudart: loads without a GPU
    lib.dspark_tree_accept_sampling_workspace_size.restype = ctypes.c_size_t
    assert lib.dspark_tree_accept_sampling_workspace_size(3, 1000) == 3 * 1000 * 4
    assert lib.dspark_tree_attention_mask(None, None, 1, 0, None, None, None, None) == CUDA_INVALID_VALUE
    assert lib.dspark_tree_accept_greedy(*[None] * 4, 1, 4, -1, *[None] * 5) == CUDA_INVALID_VALUE


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    """Skips without a GPU; otherwise points DSPARK_PLUGINS_LIB at a fresh build of the kernels."""
    try:
        cuda.cudart()
    except cuda.CudaUnavailableError as err:
        pytest.skip(f"CUDA kernel checks need a GPU: {err}")
    if find_nvcc() is None:
        pytest.skip("a GPU is visible but nvcc is not: cannot build the kernels")
    out = tmp_path_factory.mktemp("plugins_build")
    proc, _ = build(out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    previous = os.environ.get("DSPARK_PLUGINS_LIB")
    os.environ["DSPARK_PLUGINS_LIB"] = str(out / cuda.LIBRARY_NAME)
    yield
    if previous is None:
        os.environ.pop("DSPARK_PLUGINS_LIB")
    else:
        os.environ["DSPARK_PLUGINS_LIB"] = previous


def assert_same_result(got, want) -> None:
    for name in ("accepted_path", "accept_length", "bonus_token", "kv_keep"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("int32_mask", [False, True])
@pytest.mark.parametrize("n", [1, 7, 33, 100])
def test_mask_kernel_matches_reference(gpu, n, int32_mask):
    rng = np.random.default_rng(n)
    parents, _ = random_trees(rng, batch=9, n=n)
    parents[0, 1:] = np.arange(n - 1)  # a chain: deepest rows, every bit of the last row set
    past = rng.integers(0, 1000, size=9)
    for got, want in zip(cuda.run_tree_attention_mask(parents, past), tree_attention_mask(parents, past), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("max_depth", [0, 2, 40])
def test_greedy_kernel_matches_reference(gpu, max_depth):
    rng = np.random.default_rng(max_depth)
    batch, n = 300, 41  # 300 requests: more than one block of the greedy launch
    parents, tokens = random_trees(rng, batch, n, pad=0.1, vocab=3)
    targets = rng.integers(3, size=(batch, n))
    past = rng.integers(0, 500, size=batch)
    got = cuda.run_tree_accept_greedy(parents, tokens, past, targets, max_depth)
    assert_same_result(got, tree_accept_greedy(parents, tokens, past, targets, max_depth))


@pytest.mark.gpu
@pytest.mark.parametrize(("vocab", "process", "max_depth"), [(7, "iid", 5), (7, "deterministic", 5), (5000, "iid", 2)])
def test_sampling_kernel_matches_reference(gpu, vocab, process, max_depth):
    rng = np.random.default_rng(vocab)
    batch, n = 64, 16
    parents, tokens = random_trees(rng, batch, n, pad=0.1, vocab=min(vocab, 7))
    # peaked targets so that many children are accepted; float32 as the kernel reads them
    target = rng.dirichlet(np.full(vocab, 0.3), size=(batch, n)).astype(np.float32)
    target[:, :, :7] += 0.5
    target /= target.sum(-1, keepdims=True)
    parent_q = rng.dirichlet(np.ones(vocab), size=(batch, n))
    draft = child_draft_probs(parents=parents, draft_tokens=tokens, parent_probs=parent_q, process=process)
    draft = draft.astype(np.float32)
    uniforms = rng.random((batch, n)).astype(np.float32)
    past = rng.integers(0, 500, size=batch)
    got = cuda.run_tree_accept_sampling(parents, tokens, past, target, draft, uniforms, max_depth)
    want = tree_accept_sampling(parents, tokens, past, target, draft, uniforms, max_depth)
    assert (want.accept_length > 1).any()
    assert_same_result(got, want)


@pytest.mark.gpu
def test_the_api_runs_the_kernels_on_cuda_tensors(gpu):
    """What the engine's tree verification calls with its cache on a GPU: masks and greedy acceptance made
    on the device by the kernels (no host round trip), equal to the references."""
    import torch

    from dspark import plugins
    from dspark.plugins.tree_attention_mask.reference import compose_full_mask

    rng = np.random.default_rng(7)
    parents, tokens = random_trees(rng, 9, 17, pad=0.1, vocab=3)
    past = rng.integers(0, 500, size=9)
    mask = plugins.tree_attention_mask(torch.from_numpy(parents).cuda(), past)
    assert mask.mask.is_cuda and mask.mask.dtype == torch.bool
    for got, want in zip((mask.mask, mask.position_ids, mask.packed_mask), tree_attention_mask(parents, past),
                         strict=True):
        np.testing.assert_array_equal(got.cpu().numpy(), want)
    full = plugins.compose_full_mask(mask.mask, past, 600)
    np.testing.assert_array_equal(full.cpu().numpy(), compose_full_mask(tree_attention_mask(parents, past)[0], past,
                                                                        600))
    targets = rng.integers(3, size=(9, 17))
    got = plugins.tree_accept_greedy(parents=parents, draft_tokens=tokens, past_lengths=past,
                                     target_tokens=torch.from_numpy(targets).cuda(), max_depth=5)
    assert got.accepted_path.is_cuda
    assert_same_result(type(got)(*(a.cpu().numpy() for a in (got.accepted_path, got.accept_length, got.bonus_token,
                                                             got.kv_keep))),
                       tree_accept_greedy(parents, tokens, past, targets, 5))
