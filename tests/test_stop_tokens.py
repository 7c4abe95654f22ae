"""Where a request ends when a step commits several tokens at once (trained golden pair, greedy).

- A stop token among the drafts accepted in one step (accepted draft 2 of ≥ 3): the output ends
  exactly at it, equal to the target's own greedy output cut at its first stop token.
- A stop token that first appears just past max_new_tokens, in the step's overshoot: the output is
  cut at max_new_tokens and the finish reason is "length", not "stop".
Checked in the batched engine (fixed γ and Algorithm 1), `Runtime.generate` and the reference decoder.
"""

from __future__ import annotations

import pytest
from conftest import golden_path, load_json

from dspark.models import load_pair
from dspark.runtime.api import Runtime, RuntimeOptions
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate
from dspark.runtime.torch_backend import TorchBackend

SET = "qwen3-tiny-vanilla"
NEW_TOKENS = 64
COST = StepCostModel(intercept=1e-3, per_request=2e-4, per_token=4e-4)  # Algorithm 1 admits long prefixes
MODES = ["fixed", "dspark"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    return load_pair(golden_path(SET, "target"), golden_path(SET, "drafter"))


@pytest.fixture(scope="module")
def prompt():
    return load_json(golden_path(SET, "traces.json"))["samples"][0]["prompt_ids"]


def run_engine(pair, prompt, mode: str, *, max_new_tokens: int, stop: tuple[int, ...] = ()):
    target, drafter = pair
    # token_budget off: these runs are about a step that commits past max_new_tokens (fixed γ still does)
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(2, 4096, 256), scheduler=SchedulerConfig(mode, token_budget=False),
                         cost_model=COST)
    request = engine.submit(prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop)
    return engine.run_until_done()[request]


def blocks(acceptance_lengths: list[int]) -> list[tuple[int, int]]:
    """(index in the output of the step's first committed token, tokens the step committed) per step;
    the first output token comes from the prefill."""
    out, begin = [], 1
    for accepted in acceptance_lengths:
        out.append((begin, accepted))
        begin += accepted
    return out


@pytest.fixture(scope="module", params=MODES)
def unstopped(request, pair, prompt):
    """Mode, and the greedy output without a stop token (= the target's own) with its steps."""
    result = run_engine(pair, prompt, request.param, max_new_tokens=NEW_TOKENS)
    assert result.tokens == autoregressive_generate(pair[0], prompt, max_new_tokens=NEW_TOKENS)
    return request.param, result


def mid_block_stop(tokens: list[int], acceptance_lengths: list[int]) -> tuple[int, int]:
    """(index, token): the second accepted draft of a step that accepted at least 3 drafts, a token not
    seen earlier in the output; so the step commits drafts after it, and the bonus."""
    for begin, accepted in blocks(acceptance_lengths):
        index = begin + 1  # draft 2; the step's drafts are tokens[begin : begin + accepted - 1]
        if accepted - 1 >= 3 and index < len(tokens) and tokens[index] not in tokens[:index]:
            return index, tokens[index]
    raise AssertionError(f"no step accepted 3 drafts with a fresh second draft: {acceptance_lengths}")


def overshoot_cut(tokens: list[int], acceptance_lengths: list[int]) -> tuple[int, int]:
    """(max_new_tokens M, token): a step commits output indices M-1 and M at once, and tokens[M] is not
    among tokens[:M]; so a stop on tokens[M] lies just past the limit, in that step's overshoot."""
    for begin, accepted in blocks(acceptance_lengths):
        for m in range(begin + 1, begin + accepted):
            if 8 <= m < len(tokens) and tokens[m] not in tokens[:m]:
                return m, tokens[m]
    raise AssertionError(f"no step overshoots with a fresh token: {acceptance_lengths}")


def test_stop_token_among_accepted_drafts_ends_the_output_there(pair, prompt, unstopped):
    mode, full = unstopped
    index, stop = mid_block_stop(full.tokens, full.acceptance_lengths)
    expected = autoregressive_generate(pair[0], prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
    assert expected == full.tokens[: index + 1]
    result = run_engine(pair, prompt, mode, max_new_tokens=NEW_TOKENS, stop=(stop,))
    assert result.tokens == expected and result.finish_reason == "stop"
    # the stop really sat inside the last step: it committed more tokens after it
    begin, accepted = blocks(result.acceptance_lengths)[-1]
    assert begin <= index < begin + accepted - 2


def test_stop_token_among_accepted_drafts_in_the_reference_and_runtime(pair, prompt):
    target, drafter = pair
    full = speculative_generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS)
    index, stop = mid_block_stop(full.tokens, [r.acceptance_length for r in full.rounds])
    expected = full.tokens[: index + 1]
    ref = speculative_generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
    assert ref.tokens == expected and ref.stopped_by_token
    options = RuntimeOptions(scheduler=SchedulerConfig("fixed"), max_requests=2, max_seq_len=256)
    with Runtime(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), options) as runtime:
        (result,) = runtime.generate(prompt, max_new_tokens=NEW_TOKENS, stop=[stop])
    assert result.tokens == expected and result.finish_reason == "stop"


def test_stop_token_just_past_max_new_tokens_is_a_length_finish(pair, prompt, unstopped):
    mode, full = unstopped
    limit, stop = overshoot_cut(full.tokens, full.acceptance_lengths)
    assert autoregressive_generate(pair[0], prompt, max_new_tokens=limit, stop_token_ids=[stop]) == full.tokens[:limit]
    result = run_engine(pair, prompt, mode, max_new_tokens=limit, stop=(stop,))
    assert result.tokens == full.tokens[:limit] and result.finish_reason == "length"
    assert sum(result.acceptance_lengths) + 1 > limit  # the last step committed past the limit
    # the same token as the last one allowed is a stop
    at_limit = run_engine(pair, prompt, mode, max_new_tokens=limit + 1, stop=(stop,))
    assert at_limit.tokens == full.tokens[: limit + 1] and at_limit.finish_reason == "stop"


def test_stop_token_just_past_max_new_tokens_in_the_reference_and_runtime(pair, prompt):
    target, drafter = pair
    full = speculative_generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS)
    limit, stop = overshoot_cut(full.tokens, [r.acceptance_length for r in full.rounds])
    ref = speculative_generate(target, drafter, prompt, max_new_tokens=limit, stop_token_ids=[stop])
    assert ref.tokens == full.tokens[:limit] and not ref.stopped_by_token
    options = RuntimeOptions(scheduler=SchedulerConfig("fixed"), max_requests=2, max_seq_len=256)
    with Runtime(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter), options) as runtime:
        (result,) = runtime.generate(prompt, max_new_tokens=limit, stop=[stop])
    assert result.tokens == full.tokens[:limit] and result.finish_reason == "length"


def test_reference_decoder_stops_decoding_at_a_stop_among_accepted_drafts(pair, prompt):
    target, drafter = pair
    full = speculative_generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS)
    index, stop = mid_block_stop(full.tokens, [r.acceptance_length for r in full.rounds])
    ref = speculative_generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
    assert 1 + sum(r.acceptance_length for r in ref.rounds[:-1]) <= index  # the last round committed the stop
