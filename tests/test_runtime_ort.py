"""The ONNX Runtime backend on a real `dspark-export` of the golden pair: golden traces (ids and
per-round accepted lengths, fixed γ = block size) and greedy equality with mid-flight arrivals,
through both the concat and the in-place static-cache target graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import golden_path, load_json

from dspark.export.pipeline import export_pair
from dspark.models import load_pair
from dspark.runtime.backend import BackendError
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.kv_cache import Capacity
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.ort_backend import OrtBackend
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.reference_decoder import autoregressive_generate

SET = "qwen3-tiny-vanilla"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    export_pair(golden_path(SET, "target"), golden_path(SET, "drafter"), out, check=False)
    return OrtBackend(out, intra_op_threads=1)


def engine(backend, kv_mode, mode="fixed", capacity=None):
    capacity = capacity or Capacity(4, 4096, 256)
    return BatchEngine(backend, ModelInfo.from_manifest(backend.manifest), capacity=capacity,
                  scheduler=SchedulerConfig(mode), kv_mode=kv_mode,
                  cost_model=StepCostModel(1e-3, 2e-4, 4e-4))


@pytest.mark.parametrize("kv_mode", ["static", "concat"])
def test_golden_traces_through_ort(exported, kv_mode):
    traces = load_json(golden_path(SET, "traces.json"))
    e = engine(exported, kv_mode)
    ids = [e.submit(s["prompt_ids"], max_new_tokens=65) for s in traces["samples"]]
    finished = e.run_until_done()
    for request_id, sample in zip(ids, traces["samples"], strict=True):
        assert finished[request_id].tokens[:64] == sample["generated_ids"][:64]
        assert finished[request_id].acceptance_lengths == sample["acceptance_lengths"]


def test_ort_greedy_equals_target_with_mid_flight_arrivals(exported):
    target, _ = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
    e = engine(exported, "static", mode="dspark", capacity=Capacity(2, 4096, 128))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 21, 8, 40)]
    ids = []
    for prompt in prompts:
        ids.append(e.submit(prompt, max_new_tokens=24))
        e.step()
    finished = e.run_until_done()
    for request_id, prompt in zip(ids, prompts, strict=True):
        assert finished[request_id].tokens == autoregressive_generate(target, prompt, max_new_tokens=24)


def test_feeds_checked_against_export_metadata(exported):
    with pytest.raises(BackendError, match="missing feeds"):
        exported.run("target", {"input_ids": torch.zeros(1, 1, dtype=torch.int64)})
    with pytest.raises(BackendError, match="no graph"):
        exported.run("nope", {})
