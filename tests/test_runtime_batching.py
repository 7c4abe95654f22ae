"""The continuous-batching loop: golden traces, target-greedy equality with mid-flight arrivals,
per-request sampling streams, admission control and malformed requests."""

from __future__ import annotations

import pytest
import torch
from conftest import golden_path, load_json, random_pair

from dspark.models import load_pair
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.kv_cache import Capacity, CapacityError
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate
from dspark.runtime.requests import RequestError
from dspark.runtime.torch_backend import TorchBackend

# A cost model under which Algorithm 1 admits some drafts and refuses others.
COST = StepCostModel(intercept=1e-3, per_request=2e-4, per_token=4e-4)
DEFAULT_CAPACITY = Capacity(8, 4096, 256)


def make_engine(target, drafter, *, mode="fixed", kv_mode="concat", capacity=DEFAULT_CAPACITY,
                backend=None, **scheduler) -> BatchEngine:
    backend = backend or TorchBackend(target, drafter)
    return BatchEngine(backend, ModelInfo.from_models(target, drafter), capacity=capacity,
                  scheduler=SchedulerConfig(mode, **scheduler), cost_model=COST, kv_mode=kv_mode)


GOLDEN = [("qwen3-tiny-vanilla", "drafter", "traces.json", "fixed"),
          ("qwen3-tiny-vanilla", "drafter", "traces_threshold_0.5.json", "threshold"),
          ("qwen3-tiny-gated-rnn", "drafter_rnn", "traces_rnn.json", "fixed"),
          ("dflash-tiny", "drafter", "traces.json", "fixed")]


@pytest.mark.parametrize(("golden_set", "drafter_dir", "trace_file", "mode"), GOLDEN)
def test_golden_traces_through_batched_loop(golden_set, drafter_dir, trace_file, mode):
    target, drafter = load_pair(golden_path(golden_set, "target"), golden_path(golden_set, drafter_dir))
    traces = load_json(golden_path(golden_set, trace_file))
    engine = make_engine(target, drafter, mode=mode)
    ids = [engine.submit(s["prompt_ids"], max_new_tokens=65) for s in traces["samples"]]
    finished = engine.run_until_done()
    for request_id, sample in zip(ids, traces["samples"], strict=True):
        result = finished[request_id]
        assert result.tokens[:64] == sample["generated_ids"][:64]
        assert result.acceptance_lengths == sample["acceptance_lengths"]
        assert result.proposal_lengths == sample["proposal_lengths"]


@pytest.mark.parametrize(("mode", "kv_mode"), [("dspark", "concat"), ("dspark", "static"),
                                               ("threshold", "concat"), ("off", "static")])
def test_greedy_equals_target_with_requests_arriving_mid_flight(mode, kv_mode):
    target, drafter = random_pair(3, scale=6.0)
    engine = make_engine(target, drafter, mode=mode, kv_mode=kv_mode, capacity=Capacity(3, 4096, 128))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 31, (n,), generator=g).tolist() for n in (5, 17, 2, 30, 9, 1)]
    budgets = [12, 20, 7, 15, 25, 10]
    ids = {}
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        ids[engine.submit(prompt, max_new_tokens=budget)] = i
        engine.step()  # a new request joins every step while others are mid-flight
        if i == 3:
            assert engine.queue or len(engine.active) == 3
    finished = engine.run_until_done()
    assert len(finished) == len(prompts)
    for request_id, i in ids.items():
        expected = autoregressive_generate(target, prompts[i], max_new_tokens=budgets[i])
        assert finished[request_id].tokens == expected, f"prompt {i}"
    if mode == "dspark":
        decisions = [s.lengths for s in engine.stats.steps]
        assert len({k for lengths in decisions for k in lengths}) > 1  # the scheduler varied ℓ


def test_sampling_matches_reference_decoder_stream_for_stream():
    """With fixed γ, each request consumes its own seeded stream in the reference order, so
    batched sampling reproduces single-request `speculative_generate` exactly."""
    target, drafter = random_pair(5, scale=3.0)
    engine = make_engine(target, drafter, mode="fixed")
    prompts = [[1, 2, 3], [7] * 11, [4, 5]]
    ids = [engine.submit(p, max_new_tokens=16, temperature=0.8, seed=10 + i) for i, p in enumerate(prompts)]
    finished = engine.run_until_done()
    for i, request_id in enumerate(ids):
        ref = speculative_generate(target, drafter, prompts[i], max_new_tokens=16, temperature=0.8,
                                   seed=10 + i)
        assert finished[request_id].tokens == ref.tokens
        assert finished[request_id].acceptance_lengths == [r.acceptance_length for r in ref.rounds]


def test_overload_queues_and_completes():
    target, drafter = random_pair(7, scale=6.0)
    engine = make_engine(target, drafter, mode="dspark", capacity=Capacity(2, 80, 64))
    prompts = [[i + 1] * (3 + i) for i in range(7)]
    ids = [engine.submit(p, max_new_tokens=10, stop_token_ids=()) for p in prompts]
    max_queue = 0
    while not engine.idle:
        engine.step()
        max_queue = max(max_queue, len(engine.queue))
        assert len(engine.active) <= 2
        assert sum(engine.admission.reserved.values()) <= 80
    assert max_queue >= 4
    for request_id, prompt in zip(ids, prompts, strict=True):
        expected = autoregressive_generate(target, prompt, max_new_tokens=10)
        assert engine.finished[request_id].tokens == expected


def test_malformed_requests_fail_alone():
    target, drafter = random_pair(7, scale=6.0)
    engine = make_engine(target, drafter, capacity=Capacity(2, 200, 64))
    good = engine.submit([1, 2, 3], max_new_tokens=8)
    engine.step()
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.submit([1, 99], max_new_tokens=4)
    with pytest.raises(RequestError, match="empty"):
        engine.submit([], max_new_tokens=4)
    with pytest.raises(RequestError, match="temperature"):
        engine.submit([1], max_new_tokens=4, temperature=-1.0)
    with pytest.raises(CapacityError, match="slot holds 64"):
        engine.submit([1] * 60, max_new_tokens=20)
    with pytest.raises(RequestError, match="stop token"):
        engine.submit([1], max_new_tokens=4, stop_token_ids=[40])
    finished = engine.run_until_done()
    assert list(finished) == [good]
    assert finished[good].tokens == autoregressive_generate(target, [1, 2, 3], max_new_tokens=8)


def test_stop_token_ends_request_early():
    target, drafter = random_pair(3, scale=6.0)
    expected = autoregressive_generate(target, [4, 5, 6], max_new_tokens=20)
    stop = expected[5]
    engine = make_engine(target, drafter)
    request = engine.submit([4, 5, 6], max_new_tokens=20, stop_token_ids=[stop])
    result = engine.run_until_done()[request]
    assert result.tokens == expected[: expected.index(stop) + 1]
    assert result.finish_reason == "stop"


def test_refit_cost_model_uses_the_timed_steps():
    target, drafter = random_pair(5, scale=6.0)
    engine = make_engine(target, drafter, mode="dspark")
    for n in (3, 9, 14, 6):
        engine.submit(list(range(1, n + 1)), max_new_tokens=12)
    engine.run_until_done()
    refit = engine.refit_cost_model()
    assert engine.cost_model is refit and refit is not COST
    decode = [s for s in engine.stats.steps if s.requests]
    mean_step = sum(s.total_seconds - s.seconds.get("prefill", 0.0) for s in decode) / len(decode)
    mean_pred = sum(refit.seconds(s.requests, s.verified_tokens) for s in decode) / len(decode)
    assert abs(mean_pred - mean_step) <= 0.5 * mean_step  # a least-squares fit tracks the measured mean
