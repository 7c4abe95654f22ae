"""Graph replay by feed layout (runtime/cuda_graphs.py), checked on the CPU with `capture=False`: the
same bookkeeping and the same output aliasing as CUDA graphs, the module replayed eagerly. The
engine on a backend that replays this way keeps its outputs (lossless), so no caller holds a
replayed output past the next call. On a GPU, tests/test_gpu_engine.py runs the captured graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_device_kv import DEMO, PROMPTS, SCHEDULERS, _generate

from dspark.models import load_pair
from dspark.runtime.cuda_graphs import GraphCache
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.torch_backend import TorchBackend


class Affine(torch.nn.Module):
    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor]:
        return (x * 2 + cache.sum(),)


def test_a_layout_replays_from_its_second_call_into_the_same_buffers():
    graphs, module = GraphCache(torch.device("cpu"), capture=False, tune=False), Affine()
    cache = torch.ones(3)
    x = np.arange(4, dtype=np.float32)
    warm = graphs.run("g", module, [x, cache], [False, True])  # first sighting: eager
    assert not graphs.calls
    np.testing.assert_array_equal(warm[0].numpy(), x * 2 + 3)
    first = graphs.run("g", module, [x, cache], [False, True])
    assert len(graphs.calls) == 1
    np.testing.assert_array_equal(first[0].numpy(), x * 2 + 3)
    held = first[0].clone()
    cache += 1  # read in place: the replay sees the cache as it is now
    second = graphs.run("g", module, [x + 1, cache], [False, True])
    assert second[0] is first[0]  # the graph's own buffer, overwritten by the replay
    np.testing.assert_array_equal(second[0].numpy(), (x + 1) * 2 + 6)
    assert not torch.equal(held, second[0])
    for other in ([x[:3], cache], [x, torch.ones(3)]):  # another shape; another cache address: other layouts
        graphs.run("g", module, other, [False, True])
    assert len(graphs.calls) == 1


def test_at_most_max_graphs_are_captured():
    graphs, cache = GraphCache(torch.device("cpu"), max_graphs=2, capture=False, tune=False), torch.ones(1)
    for n in (1, 2, 3):
        for _ in range(2):
            graphs.run("g", Affine(), [np.zeros(n, np.float32), cache], [False, True])
    assert len(graphs.calls) == 2


class ScriptedClock:
    """Each timed call takes the next of `durations` seconds (the clock is read before and after it)."""

    def __init__(self, durations: list[float]) -> None:
        self.durations, self.now, self.reads = iter(durations), 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:
            self.now += next(self.durations)
        return self.now


def test_a_layout_keeps_replaying_only_where_replay_was_measured_faster():
    """Two timed eager calls, then two timed replays: the layout whose replays were slower goes eager."""
    clock = ScriptedClock([1, 1, 3, 3, 3, 3, 1, 1])  # "slow": eager 1 s, replay 3 s; then "fast": the reverse
    graphs = GraphCache(torch.device("cpu"), capture=False, trials=2, clock=clock)
    cache, module = torch.ones(1), Affine()
    feeds = {"slow": [np.zeros(2, np.float32), cache], "fast": [np.zeros(5, np.float32), cache]}
    for name in ["slow"] * 5 + ["fast"] * 5 + ["slow", "fast"]:  # warm-up, 2 eager, 2 replays; then decided
        out = graphs.run(name, module, feeds[name], [False, True])
        np.testing.assert_array_equal(out[0].numpy(), np.ones_like(feeds[name][0]))
    assert {layout[0] for layout in graphs.calls} == {"fast"}
    assert {layout[0] for layout in graphs.eager_layouts} == {"slow"}
    assert clock.reads == 16  # decided layouts are not timed any more


class ReplayingBackend(TorchBackend):
    """The CPU stand-in for a GPU backend: target cache as tensors, recurring layouts replayed."""

    def _open(self) -> None:
        self.graph_cache = GraphCache(torch.device("cpu"), capture=False, tune=False)

    @property
    def kv_device(self) -> torch.device:
        return torch.device("cpu")


@pytest.fixture(scope="module")
def replaying():
    target, drafter = load_pair(DEMO / "target", DEMO / "dspark")
    plain = TorchBackend(target, drafter).open()
    return plain, ReplayingBackend(target, drafter).open(), ModelInfo.from_models(target, drafter)


@pytest.mark.parametrize("method", list(SCHEDULERS))
def test_an_engine_on_replayed_graphs_equals_the_target(replaying, method):
    plain, backend, info = replaying
    expected, _ = _generate(plain, info, SchedulerConfig("off"), "concat")
    got, engine = _generate(backend, info, SCHEDULERS[method], None)
    assert engine.kv_mode == "static"  # the device-resident default: fixed shapes per (requests, tokens)
    assert any(layout[0] == "target_static" for layout in backend.graph_cache.calls)
    assert got == expected and len(got) == len(PROMPTS)


def test_sampled_streams_on_replayed_graphs_equal_the_eager_ones(replaying):
    plain, backend, info = replaying
    fixed = SchedulerConfig("fixed", fixed_length=3)
    expected, _ = _generate(plain, info, fixed, "static", slots=6, sampled=True)
    got, _ = _generate(backend, info, fixed, None, slots=6, sampled=True)
    assert got == expected
