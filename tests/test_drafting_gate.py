"""The drafting gate: skip the drafter when the cost table says drafting cannot pay; lossless."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import golden_path, load_json

from dspark.models import load_pair
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.drafting_gate import DraftingGate
from dspark.runtime.kv_cache import Capacity
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.torch_backend import TorchBackend


@dataclass(frozen=True)
class SplitCost:
    """draft(R) = draft_per_request·R; verify(R, B) = 1 ms + per_token·B."""

    draft_per_request: float
    per_token: float

    def draft_seconds(self, requests: int) -> float:
        return self.draft_per_request * requests

    def verify_seconds(self, requests: int, tokens: int) -> float:
        return 1e-3 + self.per_token * tokens

    def seconds(self, requests: int, tokens: int) -> float:
        return self.draft_seconds(requests) + self.verify_seconds(requests, tokens)

    def to_dict(self) -> dict[str, float]:
        return {"draft_per_request": self.draft_per_request, "per_token": self.per_token}


def test_gate_decision_follows_the_cost_comparison():
    cheap = DraftingGate(SplitCost(draft_per_request=1e-5, per_token=1e-4))
    dear = DraftingGate(SplitCost(draft_per_request=5e-3, per_token=1e-4))
    for gate in (cheap, dear):
        assert gate.should_draft(4)  # no estimate yet: draft to get one
        gate.record(drafted=True, requests=4, expected_accepts=4 * 2.0, verified_tokens=4 * 4)
    assert cheap.should_draft(4)
    assert not dear.should_draft(4)
    for _ in range(dear.probe_every):
        dear.record(drafted=False, requests=4, expected_accepts=None, verified_tokens=4)
    assert dear.should_draft(4)  # a probe refreshes the estimate


@pytest.mark.parametrize(("draft_cost", "expect_skips"), [(1e-6, False), (1.0, True)])
def test_engine_skips_unprofitable_drafting_and_stays_lossless(draft_cost, expect_skips):
    target, drafter = load_pair(golden_path("qwen3-tiny-vanilla", "target"),
                                golden_path("qwen3-tiny-vanilla", "drafter"))
    traces = load_json(golden_path("qwen3-tiny-vanilla", "traces.json"))
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                    capacity=Capacity(4, 4096, 256), scheduler=SchedulerConfig("dspark"),
                    cost_model=SplitCost(draft_per_request=draft_cost, per_token=1e-4), kv_mode="concat")
    ids = [engine.submit(s["prompt_ids"], max_new_tokens=64) for s in traces["samples"]]
    finished = engine.run_until_done()
    for request_id, sample in zip(ids, traces["samples"], strict=True):
        assert finished[request_id].tokens == sample["generated_ids"][:64]
    drafted = [s.drafted for s in engine.stats.steps]
    if expect_skips:
        assert drafted[0] and drafted.count(True) <= 1 + len(drafted) // engine.gate.probe_every
        assert all(max(s.lengths) == 0 for s in engine.stats.steps if not s.drafted)
    else:
        assert all(drafted)
