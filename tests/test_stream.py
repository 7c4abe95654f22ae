"""`Runtime.stream` yields, step by step, exactly the tokens `Runtime.generate` returns for the same
prompt, seed and limits: greedy and sampled, cut at a stop token inside a step's accepted drafts and
at max_new_tokens inside a step's overshoot; every chunk non-empty (trained golden pair)."""

from __future__ import annotations

import pytest
from conftest import golden_path, load_json

from dspark.models import load_pair
from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.torch_backend import TorchBackend

SET = "qwen3-tiny-vanilla"
COST = StepCostModel(intercept=1e-3, per_request=2e-4, per_token=4e-4)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["dspark", "fixed"])
def runtime(request):
    target, drafter = load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))
    # live_cost off: the comparison needs the same decisions in both runs, and a live cost model
    # decides from wall-clock step times (the output law stays exact either way); token_budget off: a step that
    # overshoots max_new_tokens is what a cut inside a step needs (fixed γ overshoots anyway)
    options = RuntimeOptions(scheduler=SchedulerConfig(request.param, token_budget=False), max_requests=2,
                             max_seq_len=256, live_cost=False)
    with Runtime(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), options, COST) as rt:
        yield rt


@pytest.fixture(scope="module")
def prompt():
    return load_json(golden_path(SET, "traces.json"))["samples"][0]["prompt_ids"]


def streamed_equals_generated(runtime: Runtime, prompt: list[int], **kwargs):
    """Stream and generate the same request; -> (chunks, the generated result)."""
    chunks = list(runtime.stream(prompt, **kwargs))
    (result,) = runtime.generate(prompt, **kwargs)
    assert all(isinstance(c, list) and c and all(isinstance(t, int) for t in c) for c in chunks), chunks
    assert [t for c in chunks for t in c] == result.tokens, kwargs
    assert len(chunks) == result.rounds  # one chunk per step: the prefill's token comes with the first
    return chunks, result


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, 0), (0.8, 3), (1.0, 11)])
def test_stream_concatenates_to_generate(runtime, prompt, temperature, seed):
    chunks, result = streamed_equals_generated(runtime, prompt, max_new_tokens=48, temperature=temperature,
                                               seed=seed)
    assert len(result.tokens) == 48 and result.finish_reason == "length"
    assert len(chunks) > 1  # streamed, not handed over at the end
    if temperature == 0.0:
        assert max(map(len, chunks)) > 2  # steps with accepted drafts stream several tokens at once


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_stream_stops_at_a_stop_token_like_generate(runtime, prompt, temperature):
    (full,) = runtime.generate(prompt, max_new_tokens=48, temperature=temperature, seed=5)
    # the first token that first appears at index >= 6: its first occurrence ends the request
    index = next(i for i in range(6, len(full.tokens)) if full.tokens[i] not in full.tokens[:i])
    stop = full.tokens[index]
    _, result = streamed_equals_generated(runtime, prompt, max_new_tokens=48, temperature=temperature, seed=5,
                                          stop=[stop])
    assert result.tokens == full.tokens[: index + 1] and result.finish_reason == "stop"


def test_stream_cut_at_max_new_tokens_inside_a_step(runtime, prompt):
    (full,) = runtime.generate(prompt, max_new_tokens=48)
    # a step committing >= 3 tokens from output index `begin`: a limit of begin + 1 cuts inside it
    begins = [1 + sum(full.acceptance_lengths[:i]) for i in range(full.rounds)]
    begin = next(b for b, a in zip(begins, full.acceptance_lengths, strict=True) if a >= 3 and b >= 4)
    for limit in (begin + 1, begin + 2):
        _, result = streamed_equals_generated(runtime, prompt, max_new_tokens=limit)
        assert result.tokens == full.tokens[:limit] and result.finish_reason == "length"
        assert 1 + sum(result.acceptance_lengths) > limit  # the last step overshot the limit
