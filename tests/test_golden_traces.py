"""Greedy decoding traces from DeepSpec: identical tokens, per-round lengths and drafts."""

from __future__ import annotations

import pytest
import torch
from conftest import GOLDEN_DRAFTERS, golden_path, load_json
from safetensors.torch import load_file

from dspark.models import load_pair
from dspark.runtime.reference_decoder import autoregressive_generate, speculative_generate

TRACES = [(s, d, stem, t) for s, d, stem, traces in GOLDEN_DRAFTERS for t in traces]
TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def pairs():
    cache = {}

    def get(set_name: str, drafter_dir: str):
        if (set_name, drafter_dir) not in cache:
            root = golden_path(set_name)
            cache[set_name, drafter_dir] = load_pair(root / "target", root / drafter_dir)
        return cache[set_name, drafter_dir]

    return get


@pytest.mark.parametrize(("set_name", "drafter_dir", "stem", "trace_file"), TRACES,
                         ids=[f"{s}/{t}" for s, _, _, t in TRACES])
def test_trace(pairs, set_name, drafter_dir, stem, trace_file):
    target, drafter = pairs(set_name, drafter_dir)
    trace = load_json(golden_path(set_name, trace_file))
    for sample in trace["samples"]:
        # DeepSpec's loop runs while fewer than max_new_tokens follow the prefill token, then
        # truncates: one token more than requested, so its last round is ours with max_new + 1.
        result = speculative_generate(
            target, drafter, sample["prompt_ids"],
            max_new_tokens=trace["max_new_tokens"] + 1,
            confidence_threshold=trace["confidence_threshold"],
        )
        assert result.tokens[: trace["max_new_tokens"]] == sample["generated_ids"]
        assert [r.acceptance_length for r in result.rounds] == sample["acceptance_lengths"]
        assert [r.accepted_drafts for r in result.rounds] == sample["accepted_draft_lengths"]
        assert [r.proposal_length for r in result.rounds] == sample["proposal_lengths"]
        for ours, golden in zip(result.rounds, sample["rounds"], strict=True):
            assert (ours.start, ours.anchor) == (golden["start"], golden["anchor_token"])
            assert ours.draft_tokens == golden["draft_tokens_full"]
            if golden.get("confidence_logits_full") is not None:
                torch.testing.assert_close(torch.tensor(ours.confidence_logits),
                                           torch.tensor(golden["confidence_logits_full"]), **TOL)
        assert sample["speculative_equals_target_only"]


@pytest.mark.parametrize("case", GOLDEN_DRAFTERS, ids=lambda c: f"{c.set_name}/{c.drafter_dir}")
def test_round_tensors(pairs, case):
    """Per-round tensors of the first three rounds of prompt 0 (KV-cached on both sides)."""
    target, drafter = pairs(case.set_name, case.drafter_dir)
    golden = load_file(str(golden_path(case.set_name, f"trace_tensors{case.stem}.safetensors")))
    prompt = load_json(golden_path(case.set_name, case.traces[0]))["samples"][0]["prompt_ids"]
    seen = []
    speculative_generate(target, drafter, prompt, max_new_tokens=20,
                         observer=lambda stats, tensors: seen.append((stats, tensors)))
    for r, (stats, t) in enumerate(seen[:3]):
        torch.testing.assert_close(t.new_context_features, golden[f"round{r}_new_context_features"], **TOL)
        positions = golden[f"round{r}_draft_position_ids"][0]
        assert torch.equal(t.context_position_ids[0], positions[: t.context_position_ids.shape[1]])
        torch.testing.assert_close(t.block_hidden, golden[f"round{r}_draft_block_hidden"], **TOL)
        torch.testing.assert_close(drafter.base_logits(t.block_hidden), golden[f"round{r}_draft_base_logits"],
                                   **TOL)
        torch.testing.assert_close(t.draft_logits, golden[f"round{r}_draft_corrected_logits"], **TOL)
        assert stats.draft_tokens == golden[f"round{r}_draft_tokens"][0].tolist()
        assert torch.equal(t.verify_input_ids, golden[f"round{r}_verify_input_ids"])
        torch.testing.assert_close(t.verify_logits, golden[f"round{r}_target_verify_logits"], **TOL)


def test_target_only_greedy_matches_golden(pairs):
    target, _ = pairs("qwen3-tiny-vanilla", "drafter")
    trace = load_json(golden_path("qwen3-tiny-vanilla", "traces.json"))
    for sample in trace["samples"]:
        ours = autoregressive_generate(target, sample["prompt_ids"], max_new_tokens=trace["max_new_tokens"])
        assert ours == sample["target_only_greedy_generated_ids"]
