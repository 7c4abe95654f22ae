"""The target's slot cache as device tensors (what `TorchBackend(device="cuda")` asks for through
`kv_device`), run here on the CPU: a wrapper names torch's CPU device, so the engine holds the cache
as torch tensors (the target's and the drafter's) and takes every tensor path a GPU run takes
(commits, tree-path gathers, the drafter's gathers of rows drafting apart, row moves, swaps to the
host tier). Outputs must equal the host-buffer engine's, greedy and sampled."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.models import load_pair
from dspark.runtime.backend import WrappedBackend
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import CacheShape, Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.kv_cache import SlotCache
from dspark.runtime.kv_tiers import HostTier
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.torch_backend import TorchBackend

DEMO = Path(str(resources.files("dspark.models") / "demo"))
COST = StepCostModel(intercept=2e-3, per_request=2e-4, per_token=1e-4)
PROMPTS = [[298, 15, 265, 303, 291], [64, 1906, 64, 2625, 27, 12, 80], [5, 6, 7], [100, 200, 300, 400, 500, 600]]
SCHEDULERS = {"chain": SchedulerConfig("dspark", gate_drafting=False),
              "tree": SchedulerConfig("dspark", drafting="tree", tree_nodes=12),
              "tree-fixed": SchedulerConfig("fixed", drafting="tree", tree_nodes=8)}


class TensorKV(WrappedBackend):
    """The inner backend, with the target cache held as torch tensors on the CPU."""

    @property
    def kv_device(self) -> torch.device:
        return torch.device("cpu")


@pytest.fixture(scope="module")
def pair():
    target, drafter = load_pair(DEMO / "target", DEMO / "dspark")
    return TorchBackend(target, drafter).open(), ModelInfo.from_models(target, drafter)


def _generate(backend, info, scheduler, kv_mode: str, slots: int = 4, tiers: HostTier | None = None,
              sampled: bool = False) -> tuple[list[list[int]], BatchEngine]:
    engine = BatchEngine(backend, info, capacity=Capacity(slots, slots * 200, 200), scheduler=scheduler,
                         cost_model=COST, kv_mode=kv_mode)
    engine.tiers = tiers
    ids = []
    for i, prompt in enumerate([*PROMPTS, [7, 8, 9, 10], [11, 12]] if sampled else PROMPTS):
        options = {"temperature": 1.0, "seed": i} if sampled and i % 2 else {}
        ids.append(engine.submit(prompt, max_new_tokens=24, **options))
        engine.step()  # requests arrive mid-flight
    finished = engine.run_until_done()
    return [finished[i].tokens for i in ids], engine


@pytest.mark.parametrize("kv_mode", ["concat", "static"])
@pytest.mark.parametrize("method", list(SCHEDULERS))
def test_greedy_with_tensor_kv_equals_the_target(pair, kv_mode, method):
    backend, info = pair
    expected, _ = _generate(backend, info, SchedulerConfig("off"), kv_mode)
    got, engine = _generate(TensorKV(backend), info, SCHEDULERS[method], kv_mode)
    assert isinstance(engine.target_kv.keys[0], torch.Tensor)
    assert isinstance(engine.drafter_kv.keys[0], torch.Tensor)  # the drafter's cache too
    assert max(n for s in engine.stats.steps for n in s.acceptance_lengths) > 1
    assert got == expected


def test_swaps_to_the_host_tier_from_tensor_kv(pair):
    """Two device slots and a host tier hold six requests (greedy and seeded), with the tokens of six slots."""
    backend, info = pair
    fixed = SchedulerConfig("fixed", fixed_length=3)
    expected, _ = _generate(backend, info, fixed, "concat", slots=6, sampled=True)
    host = HostTier(host_tokens=4 * 200, quantum=2)
    got, _ = _generate(TensorKV(backend), info, fixed, "concat", slots=2, tiers=host, sampled=True)
    assert host.stats.swaps_out == host.stats.swaps_in > 0
    assert got == expected


def test_a_tensor_slot_cache_commits_like_a_host_one():
    shape, rng = CacheShape(layers=2, kv_heads=2, head_dim=4), np.random.default_rng(0)
    host, tensor = SlotCache(shape, 3, 16), SlotCache(shape, 3, 16, device="cpu")
    for counts in ([3, 0, 5], [1, 2, 2]):
        present = [(rng.standard_normal((3, 2, 6, 4), dtype=np.float32),
                    rng.standard_normal((3, 2, 6, 4), dtype=np.float32)) for _ in range(2)]
        host.write(present, source_offset=1, counts=counts)
        tensor.write([(torch.from_numpy(k), torch.from_numpy(v)) for k, v in present], source_offset=1,
                     counts=counts)
    host.move(2, 0)
    tensor.move(2, 0)
    assert (host.lengths == tensor.lengths).all()
    for a, b in zip(host.kv, tensor.kv, strict=True):
        np.testing.assert_array_equal(a, b.numpy())


def test_the_cpu_backend_keeps_kv_on_the_host(pair):
    backend, _ = pair
    assert backend.kv_device is None and TensorKV(backend).kv_device == torch.device("cpu")


def test_a_tensor_tree_mask_is_composed_like_the_reference():
    from dspark import plugins

    parents = np.array([[-1, 0, 0, 1, -2], [-1, 0, 1, 2, 3]])
    past = np.array([3, 6])
    mask = plugins.tree_attention_mask(parents, past).mask
    want = plugins.compose_full_mask(mask, past, 8)
    got = plugins.compose_full_mask(torch.from_numpy(mask), past, 8)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("overlap", [False, True], ids=["probes-in-line", "probes-overlapped"])
@pytest.mark.usefixtures("probes_whatever_the_ceiling")
@pytest.mark.parametrize("case", ["skip-and-probe", "middle", "long-prompt"])
def test_probes_and_rows_drafting_apart_over_tensor_caches(case, overlap):
    """The drafting gate's partial steps over tensor caches: probe rows (not one contiguous range) and a
    long prompt's row drafting apart gather and scatter the drafter's cache by index, in the step or on the
    probe worker; greedy output stays the target's (the golden pair of tests/test_drafting_gate.py)."""
    from test_drafting_gate import CHEAP, DEAR, SplitCost
    from test_drafting_gate_engine import drafted_rows, greedy, launches, prompts, run
    from test_drafting_gate_engine import pair as golden_pair

    target, drafter = golden_pair()
    cost = {"skip-and-probe": DEAR, "middle": SplitCost(4e-4, 1e-4), "long-prompt": CHEAP}[case]
    scheduler = SchedulerConfig("dspark", overlap_probes=overlap)
    engine = BatchEngine(TensorKV(TorchBackend(target, drafter)), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(6, 1 << 16, 1024), scheduler=scheduler, cost_model=cost, kv_mode="concat")
    launched = launches(engine)
    p, new = list(prompts()), 24
    arrivals = ({0: p[:5], 4: [p[2] * 4]} if case == "long-prompt"
                else {0: p[:3], 2: p[3:5], 5: p[5:7], 11: p[7:10], 19: p[:2]})
    asked = run(engine, arrivals, new)
    finished = engine.take_finished()
    assert isinstance(engine.drafter_kv.keys[0], torch.Tensor)
    assert [finished[i].tokens for i in asked] == [greedy(prompt, new) for prompt in asked.values()]
    if case != "long-prompt":  # probes happened
        assert bool(launched) if overlap else any(0 < len(drafted_rows(s)) < s.requests for s in engine.stats.steps)


def test_deterministic_draft_probs_made_on_a_tensor_equal_the_reference():
    """The sampling accept's draft rows for best-first trees, built where the probabilities live."""
    from test_plugins_reference import random_trees

    from dspark import plugins
    from dspark.plugins.tree_accept.draft_probs import child_draft_probs

    rng = np.random.default_rng(3)
    parents, tokens = random_trees(rng, 6, 17, pad=0.2, vocab=9)
    q = rng.dirichlet(np.ones(9), size=(6, 17)).astype(np.float32)
    got = plugins.child_draft_probs(parents=parents, draft_tokens=tokens, parent_probs=torch.from_numpy(q),
                                    process="deterministic")
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), child_draft_probs(parents, tokens, q, "deterministic"))
