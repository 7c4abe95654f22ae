"""The continuous-batching loop: golden traces, target-greedy equality with mid-flight arrivals,
per-request sampling streams, admission control and malformed requests."""

from __future__ import annotations

import pytest
import torch
from conftest import golden_path, load_json, random_pair

from dspark.models import load_pair
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity, CapacityError
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate
from dspark.runtime.requests import RequestError
from dspark.runtime.stats import StepRecord
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


@pytest.mark.parametrize("ends", ["length", "stop"])
def test_a_request_its_prefill_ends_leaves_in_that_step(ends):
    """Its prefill's token ends it: it leaves before any row decodes (no step runs for it, none is wasted)."""
    target, drafter = random_pair(3, scale=6.0)
    first = autoregressive_generate(target, [4, 5, 6], max_new_tokens=1)[0]
    engine = make_engine(target, drafter, mode="dspark")
    request = engine.submit([4, 5, 6], max_new_tokens=1 if ends == "length" else 20,
                            stop_token_ids=[first] if ends == "stop" else [])
    assert engine.step() is None  # the step prefilled it and found no row left to decode
    result = engine.take_finished()[request]
    assert result.tokens == [first]
    assert result.finish_reason == ends
    assert engine.idle


def step_record(step: int, requests: int, tokens: int, seconds: float, *, prefill: float = 0.0,
                drafted: bool = True) -> StepRecord:
    """A decode step that took `seconds` (spread over the phases) plus `prefill` seconds of prefill."""
    phases = {"prefill": prefill, "draft": 0.3 * seconds, "heads": 0.1 * seconds, "schedule": 0.05 * seconds,
              "verify": 0.45 * seconds, "commit": 0.1 * seconds}
    lengths = [tokens // requests - 1] * requests if requests else []
    return StepRecord(step=step, requests=requests, admitted_new=0, lengths=lengths, verified_tokens=tokens,
                      padded_tokens=tokens, acceptance_lengths=[1] * requests, expected_accepts=None,
                      predicted_seconds=None, seconds=phases, drafted=drafted)


def test_refit_cost_model_fits_the_recorded_step_times():
    """Injected timings from a known t(R, B): the refit recovers its coefficients, leaving out prefill
    time, idle steps, steps that skipped drafting and steps older than the window."""
    target, drafter = random_pair(5, scale=6.0)
    engine = make_engine(target, drafter, mode="dspark")
    law = StepCostModel(intercept=2e-3, per_request=5e-4, per_token=3e-4)
    stale = StepCostModel(intercept=9e-2, per_request=0.0, per_token=1e-2)
    g = torch.Generator().manual_seed(0)
    step = 0
    for _ in range(30):  # older than the last 64 steps: must not count
        engine.stats.record(step_record(step, 2, 6, float(stale.seconds(2, 6))))
        step += 1
    for i in range(64):
        requests = int(torch.randint(1, 5, (1,), generator=g))
        tokens = requests + int(torch.randint(0, 7 * requests + 1, (1,), generator=g))
        if i % 9 == 4:  # a step where the drafting gate skipped drafting: another kind of step
            record = step_record(step, requests, requests, 0.5, drafted=False)
        elif i % 13 == 6:  # an idle step (nothing active): prefill time only
            record = step_record(step, 0, 0, 0.0, prefill=0.25)
        else:  # prefill time of newly admitted requests is not part of t(R, B)
            prefill = 0.2 if i % 5 == 0 else 0.0
            record = step_record(step, requests, tokens, float(law.seconds(requests, tokens)), prefill=prefill)
        engine.stats.record(record)
        step += 1
    refit = engine.refit_cost_model()
    assert engine.cost_model is refit and refit is not COST
    for got, want in zip((refit.intercept, refit.per_request, refit.per_token),
                         (law.intercept, law.per_request, law.per_token), strict=True):
        assert got == pytest.approx(want, rel=0, abs=1e-9)
    for requests, tokens in ((1, 1), (3, 10), (8, 64)):
        assert float(refit.seconds(requests, tokens)) == pytest.approx(float(law.seconds(requests, tokens)),
                                                                       rel=0, abs=1e-9)
    # a shorter window sees only the stale law's steps when they are the most recent
    for _ in range(3):
        for requests, tokens in ((1, 2), (2, 9), (4, 5)):
            engine.stats.record(step_record(step, requests, tokens, float(stale.seconds(requests, tokens))))
            step += 1
    recent = engine.refit_cost_model(last_steps=9)
    assert (recent.intercept, recent.per_request, recent.per_token) == pytest.approx(
        (stale.intercept, stale.per_request, stale.per_token), rel=0, abs=1e-9)
