"""Greedy speculative decoding equals target-only greedy decoding, token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import golden_path, random_pair

from dspark.models import load_pair
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate

HEADS = [
    dict(markov_head_type="vanilla"),
    dict(markov_head_type="gated"),
    dict(markov_head_type="rnn", confidence_head_with_markov=False),
    dict(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False),  # DFlash
]


pytestmark = pytest.mark.usefixtures("one_thread")


def check_rounds(result, prompt: list[int], *, max_new_tokens: int, gamma: int) -> None:
    """The per-round stats account for every generated token. Round i starts at output index
    b_i = 1 + Σ_{j<i} acceptance_length_j (the first token comes from the prefill), its anchor is the
    token before, it commits its first a_i drafts then the bonus, and a rejected greedy draft differs
    from the token committed in its place. The loop runs while fewer than max_new_tokens are committed,
    so the last round starts below the limit and the output is cut at it; or the output ends at a stop
    token one of the rounds committed."""
    tokens, begin, last = result.tokens, 1, 0
    for r in result.rounds:
        if begin > len(tokens):  # past a stop token among one round's accepted drafts (see test_stop_tokens)
            assert result.stopped_by_token
            break
        a = r.accepted_drafts
        assert r.acceptance_length == a + 1 and 0 <= a <= r.proposal_length <= gamma == len(r.draft_tokens)
        assert r.start == len(prompt) + begin - 1 and r.anchor == tokens[begin - 1]
        committed = tokens[begin : begin + a]
        assert committed == r.draft_tokens[: len(committed)]
        if a < r.proposal_length and begin + a < len(tokens):
            assert r.draft_tokens[a] != tokens[begin + a]  # greedy: the first rejected draft is not the target's
        begin += r.acceptance_length
        last = r.acceptance_length
    # `begin` is now 1 + Σ acceptance lengths (of the rounds checked): the output's length before the cut
    if result.stopped_by_token:
        assert begin - last < len(tokens) <= begin  # the stop token came in the last round checked
    else:
        assert begin - last < max_new_tokens  # the last round started with fewer than max_new_tokens committed
        assert len(tokens) == max_new_tokens <= begin


@pytest.mark.parametrize("seed", range(6))
def test_random_models_prompts_and_block_sizes(seed):
    gen = torch.Generator().manual_seed(seed)
    head = HEADS[seed % len(HEADS)]
    target, drafter = random_pair(seed, drafter_overrides=head, scale=12.0,
                                  target_overrides=dict(qk_norm=seed % 2 == 0))
    for trial in range(3):
        n = int(torch.randint(1, 12, (1,), generator=gen))
        prompt = torch.randint(0, 31, (n,), generator=gen).tolist()
        gamma = 1 + (seed + trial) % 6
        threshold = 0.5 if drafter.confidence_head is not None and trial == 2 else 0.0
        expected = autoregressive_generate(target, prompt, max_new_tokens=24)
        result = speculative_generate(target, drafter, prompt, max_new_tokens=24, block_size=gamma,
                                      confidence_threshold=threshold)
        assert result.tokens == expected, f"gamma={gamma} threshold={threshold} prompt={prompt}"
        check_rounds(result, prompt, max_new_tokens=24, gamma=gamma)


def test_trained_golden_pair_on_random_prompts_accepts_and_stays_lossless():
    root = golden_path("qwen3-tiny-vanilla")
    target, drafter = load_pair(root / "target", root / "drafter")
    gen = torch.Generator().manual_seed(7)
    accepted = 0
    for gamma in (1, 3, 7, 9):
        prompt = torch.randint(0, 500, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        result = speculative_generate(target, drafter, prompt, max_new_tokens=40, block_size=gamma)
        assert result.tokens == autoregressive_generate(target, prompt, max_new_tokens=40)
        check_rounds(result, prompt, max_new_tokens=40, gamma=gamma)
        accepted += sum(r.accepted_drafts for r in result.rounds)
    assert accepted > 20  # the path that accepts drafts is exercised, not only bonus tokens


def test_stop_tokens_end_generation_like_the_target():
    root = golden_path("qwen3-tiny-vanilla")
    target, drafter = load_pair(root / "target", root / "drafter")
    prompt = [67, 24, 319, 84, 473, 74, 431, 279]
    full = autoregressive_generate(target, prompt, max_new_tokens=30)
    stop = full[12]
    expected = autoregressive_generate(target, prompt, max_new_tokens=30, stop_token_ids=[stop])
    result = speculative_generate(target, drafter, prompt, max_new_tokens=30, stop_token_ids=[stop])
    assert result.tokens == expected and result.tokens[-1] == stop and result.stopped_by_token
    assert stop not in result.tokens[:-1]
    check_rounds(result, prompt, max_new_tokens=30, gamma=drafter.config.block_size)
