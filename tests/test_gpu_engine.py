"""The batched engine on CUDA (PyTorch backend, `device="cuda"`, the target's cache resident on the
device): chains and draft trees stay lossless, greedy and sampled. Skipped with the reason where
torch sees no CUDA device (tools/gpu_check.sh runs these on a lent GPU machine)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import torch

from dspark.models import load_pair
from dspark.runtime.backend import BackendUnavailable
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.cuda_graphs import GraphCache
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.torch_backend import TorchBackend

DEMO = Path(str(resources.files("dspark.models") / "demo"))
COST = StepCostModel(intercept=2e-3, per_request=2e-4, per_token=1e-4)
NO_CUDA = f"needs a CUDA device: torch {torch.__version__} sees none (CPU build or no GPU)"


def test_a_cuda_backend_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the refusal only happens without it")
    target, drafter = load_pair(DEMO / "target", DEMO / "dspark")
    with pytest.raises(BackendUnavailable, match="sees no CUDA device"):
        TorchBackend(target, drafter, device="cuda").open()


@pytest.fixture(scope="module")
def cuda_pair():
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    target, drafter = load_pair(DEMO / "target", DEMO / "dspark")
    return target, drafter, TorchBackend(target, drafter, device="cuda").open()


def engine(backend, info, scheduler: SchedulerConfig, slots: int = 4) -> BatchEngine:
    return BatchEngine(backend, info, capacity=Capacity(slots, slots * 200, 200), scheduler=scheduler,
                       cost_model=COST)


PROMPTS = [[298, 15, 265, 303, 291], [64, 1906, 64, 2625, 27, 12, 80], [5, 6, 7], [100, 200, 300, 400, 500, 600]]


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", [SchedulerConfig("dspark", gate_drafting=False),
                                       SchedulerConfig("dspark", drafting="tree", tree_nodes=12),
                                       SchedulerConfig("fixed", drafting="tree", tree_nodes=8)],
                         ids=["chain", "tree", "tree-fixed"])
def test_greedy_on_cuda_equals_the_target_on_cuda(cuda_pair, scheduler):
    """Lossless on the device: the same engine with drafting off (the target alone, same device,
    same batch) is the reference."""
    target, drafter, backend = cuda_pair
    info = ModelInfo.from_models(target, drafter)
    outputs = {}
    for name, config in (("target", SchedulerConfig("off")), ("speculative", scheduler)):
        e = engine(backend, info, config)
        ids = []
        for p in PROMPTS:
            ids.append(e.submit(p, max_new_tokens=24))
            e.step()  # requests arrive mid-flight
        finished = e.run_until_done()
        outputs[name] = [finished[i].tokens for i in ids]
        assert e.target_kv.keys[0].is_cuda  # the target's cache stays on the device between steps
        if name == "speculative":
            assert max(n for s in e.stats.steps for n in s.acceptance_lengths) > 1
    assert outputs["speculative"] == outputs["target"]
    assert next(target.parameters()).device.type == "cuda"


@pytest.mark.gpu
def test_cuda_graph_replay_gives_the_eager_tokens(cuda_pair):
    """The same engines on captured graphs (every recurring layout replayed, untuned; and the default,
    which keeps replay where it measured faster) and on the eager modules (same device, same kernels)."""
    target, drafter, tuned = cuda_pair
    info = ModelInfo.from_models(target, drafter)
    eager = TorchBackend(target, drafter, device="cuda", cuda_graphs=False).open()
    replaying = TorchBackend(target, drafter, device="cuda").open()
    replaying.graph_cache = GraphCache(replaying.device, tune=False)
    for config in (SchedulerConfig("off"), SchedulerConfig("dspark", gate_drafting=False),
                   SchedulerConfig("fixed", drafting="tree", tree_nodes=8)):
        outputs = []
        for b in (eager, replaying, tuned):
            e = engine(b, info, config)
            assert e.kv_mode == "static"
            ids = [e.submit(p, max_new_tokens=24) for p in PROMPTS]
            finished = e.run_until_done()
            outputs.append([finished[i].tokens for i in ids])
        assert outputs[1] == outputs[0] and outputs[2] == outputs[0], config
    assert any(layout[0] == "target_static" for layout in replaying.graph_cache.calls)
    assert tuned.graph_cache.calls or tuned.graph_cache.eager_layouts
    assert eager.graph_cache is None


@pytest.mark.gpu
def test_sampling_on_cuda_matches_the_cpu_engine_stream_for_stream(cuda_pair):
    """Fixed chains consume each request's seeded stream in the same order on either device; the
    tokens agree unless float rounding moves a draw across a boundary (rare: most must agree)."""
    target, drafter, backend = cuda_pair
    info = ModelInfo.from_models(target, drafter)
    config = SchedulerConfig("fixed", fixed_length=3)
    runs = []
    for b in (backend, None):
        if b is None:
            cpu_target, cpu_drafter = load_pair(DEMO / "target", DEMO / "dspark")
            b = TorchBackend(cpu_target, cpu_drafter)
        e = engine(b, info, config, slots=8)
        ids = [e.submit(PROMPTS[i % 4], max_new_tokens=12, temperature=1.0, seed=i) for i in range(8)]
        finished = e.run_until_done()
        runs.append([finished[i].tokens for i in ids])
    same = sum(a == b for a, b in zip(*runs, strict=True))
    assert same >= 6, runs


@pytest.mark.gpu
def test_ort_cuda_provider_trees_equal_the_target(tmp_path):
    """ONNX Runtime's CUDA execution provider (onnxruntime-gpu), host buffers bound each call: tree
    drafting over the demo pair's export stays lossless."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (pip install onnxruntime-gpu "
                    "on a machine with CUDA)")
    from dspark.export.pipeline import export_pair
    from dspark.runtime.ort_backend import OrtBackend
    from dspark.runtime.reference_decoder import autoregressive_generate

    export_pair(DEMO / "target", DEMO / "dspark", tmp_path, check=False)
    backend = OrtBackend(tmp_path, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    target, _ = load_pair(DEMO / "target", DEMO / "dspark")
    e = engine(backend, ModelInfo.from_manifest(backend.manifest), SchedulerConfig("fixed", drafting="tree",
                                                                                 tree_nodes=8))
    ids = [e.submit(p, max_new_tokens=16) for p in PROMPTS]
    finished = e.run_until_done()
    for i, p in zip(ids, PROMPTS, strict=True):
        assert finished[i].tokens == autoregressive_generate(target, p, max_new_tokens=16)


@pytest.mark.gpu
def test_tree_sampling_on_cuda_follows_the_target_law():
    """tests/test_tree_batch.py's law test with the engine on CUDA: sampled tree rows accepted by the
    TreeAccept kernel on the device (float32), greedy rows by its greedy kernel; the law at T = 0.7 must fail."""
    from sampling_law import PROMPT, VOCAB, exact_law_of_tokens_2_and_3, pooled_pvalue, small_pair
    from test_tree_batch import tree_engine

    from dspark.plugins import cuda
    from dspark.runtime.reference_decoder import autoregressive_generate

    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    if not cuda.library_path().is_file():
        pytest.skip(f"{cuda.library_path()} not built: run plugins/build.sh (tools/gpu_check.sh does)")
    reference, _ = small_pair()  # the same seeded pair, kept on the host for the exact law
    target, drafter = small_pair()
    backend = TorchBackend(target, drafter, device="cuda").open()
    engine = tree_engine(backend, ModelInfo.from_models(target, drafter), mode="fixed", kv_mode="static", slots=128,
                         nodes=4, top_k=2)
    ids = [engine.submit(PROMPT, max_new_tokens=3, temperature=1.0, seed=s) for s in range(1500)]
    greedy = engine.submit(PROMPT, max_new_tokens=6)
    finished = engine.run_until_done()
    assert finished[greedy].tokens == autoregressive_generate(reference, PROMPT, max_new_tokens=6)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for i in ids:
        counts[finished[i].tokens[1], finished[i].tokens[2]] += 1
    assert max(n for s in engine.stats.steps for n in s.acceptance_lengths) > 2
    assert pooled_pvalue(counts, exact_law_of_tokens_2_and_3(reference, 1.0)) > 1e-3
    assert pooled_pvalue(counts, exact_law_of_tokens_2_and_3(reference, 0.7)) < 1e-6
