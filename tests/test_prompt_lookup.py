"""Prompt-lookup drafts beside DSpark's: the incremental n-gram index against a brute-force search, the
per-request estimates, the copy-or-draft rule, and the engine on the demo pair: greedy output stays the
target's own, copies are used where history repeats, a request whose copies fail stops copying, nothing is
copied in steps where the drafting gate declines, and sampled copies keep the target's law (chi-square against
the exact law, with a control that verifies copies under a wrong q and must fail)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sampling_law import VOCAB, exact_law_of_tokens_2_and_3, pooled_pvalue, small_pair
from test_live_cost_engine import device_table
from tokenizers import Tokenizer

from dspark.export.cost_table import CostTable
from dspark.models import load_pair
from dspark.runtime import prompt_lookup
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig, SchedulerConfigError
from dspark.runtime.prompt_lookup import LookupState, PromptLookup, copies_pay, copy_logits
from dspark.runtime.torch_backend import TorchBackend
from dspark.tools.demo_engine import DEMO_DRAFTER, DEMO_TARGET

pytestmark = pytest.mark.usefixtures("one_thread")


def brute_continuation(history: list[int], n: int, limit: int) -> list[int]:
    """The latest earlier occurrence of the last n tokens, by scanning every position."""
    size = len(history)
    if size <= n:
        return []
    for end in range(size - 1, n - 1, -1):
        if history[end - n : end] == history[-n:]:
            copy = history[end : min(end + limit, size)]
            while len(copy) < limit:
                copy += copy[: limit - len(copy)]
            return copy
    return []


def test_incremental_index_finds_what_a_brute_force_search_finds():
    rng = random.Random(0)
    checked = hits = 0
    for trial in range(400):
        n, limit, vocab = rng.randint(1, 4), rng.randint(1, 8), rng.randint(2, 6)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        state, tokens = LookupState(n), []
        for _ in range(rng.randint(1, 10)):  # tokens arrive a few at a time, as steps commit them
            tokens += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            want = brute_continuation(prompt + tokens, n, limit)
            assert state.continuation(prompt, tokens, limit) == want, (trial, prompt, tokens, n, limit)
            checked, hits = checked + 1, hits + bool(want)
    assert checked > 1000 and 0.2 * checked < hits < checked  # matches and misses both exercised


def test_acceptance_learns_from_copies_and_drifts_back_after_failures():
    state = LookupState(3)
    assert state.acceptance == pytest.approx(prompt_lookup.PRIOR_ACCEPTANCE)
    state.verified(7, 7)
    assert state.acceptance > 0.9
    for _ in range(10):
        state.verified(7, 0)
    low = state.acceptance
    assert low < 0.35
    for _ in range(40):
        state.forget()
    assert low < state.acceptance < prompt_lookup.PRIOR_ACCEPTANCE  # tries again, not at once
    assert state.survivals(3, 5).tolist() == pytest.approx([state.acceptance ** k for k in (1, 2, 3)] + [0, 0])


def test_a_copy_is_chosen_when_it_returns_more_tokens_per_second():
    assert copies_pay(3.0, 4.0, draft_share=1.0, verify_share=1.0)  # 4 tokens in 1 s against 5 in 2 s
    assert not copies_pay(1.0, 4.0, draft_share=1.0, verify_share=1.0)  # 2 in 1 s against 5 in 2 s
    assert not copies_pay(3.0, 4.0, draft_share=0.1, verify_share=1.0)  # drafting nearly free: DSpark's 5
    assert copies_pay(4.0, 4.0, draft_share=0.0, verify_share=1.0)  # no split cost model: promise as much


def request(prompt: list[int], tokens: list[int], temperature: float = 0.0,
            max_new_tokens: int = 64) -> SimpleNamespace:
    return SimpleNamespace(temperature=temperature, lookup=None, max_new_tokens=max_new_tokens,
                           result=SimpleNamespace(prompt_ids=prompt, tokens=tokens))


def test_nothing_is_weighed_before_a_dspark_block_and_sampling_rows_copy_with_a_point_mass():
    lookup = PromptLookup(2, block_size=4, cost=device_table(), max_tokens=4)
    repeating = [5, 6, 7, 8] * 4
    active = [request(repeating, [5]), request(repeating, [5], temperature=1.0), request([1, 2, 3], [4])]
    assert lookup.propose(active, room=64) is None  # no DSpark block seen yet: nothing to weigh a copy against
    lookup.dspark_accepts = 1.0
    copies = lookup.propose(active, room=64)
    assert copies.rows.tolist() == [0, 1]  # row 2's history has no earlier match
    assert copies.tokens[0].tolist() == [6, 7, 8, 5] and copies.tokens[2].tolist() == [0, 0, 0, 0]
    assert copies.survivals[0, 0] == pytest.approx(prompt_lookup.PRIOR_ACCEPTANCE) and not copies.survivals[2].any()
    logits = copy_logits(copies, None, [0.0, 1.0, 0.0], vocab_size=10)
    q = torch.softmax(logits[1], dim=-1)  # the sampling row's draft law: all mass on its copy
    assert torch.equal(q, torch.nn.functional.one_hot(torch.tensor([6, 7, 8, 5]), 10).float())
    assert copy_logits(copies, None, [0.0, 0.0, 0.0], vocab_size=10) is None  # greedy rows read no logits


def test_copies_run_past_the_block_but_never_past_what_the_request_still_needs():
    lookup = PromptLookup(2, block_size=4, cost=device_table(), max_tokens=10)
    lookup.dspark_accepts = 1.0
    repeating = [5, 6, 7, 8] * 4
    rows = [request(repeating, [5]), request(repeating, [5], max_new_tokens=4)]
    copies = lookup.propose(rows, room=64)
    assert copies.tokens.shape == (2, 10)  # the step's draft rows are as wide as the longest copy
    assert copies.tokens[0].tolist() == [6, 7, 8, 5] * 2 + [6, 7]
    assert copies.tokens[1].tolist() == [6, 7, 8] + [0] * 7  # 3 tokens to go: a longer copy is wasted work
    assert lookup.propose(rows, room=5).tokens[0].tolist() == [6, 7, 8, 5, 6] + [0] * 5  # the fullest slot's room
    assert (copies.survivals[1, 3:] == 0).all() and (copies.survivals[0] > 0).all()
    assert PromptLookup(2, block_size=4).max_tokens == 8  # twice the block by default


def test_dspark_logits_widen_for_a_long_copy_beside_them():
    lookup = PromptLookup(2, block_size=4, cost=device_table(), max_tokens=6)
    lookup.dspark_accepts = 1.0
    active = [request([1, 2, 3], [4], temperature=1.0), request([5, 6, 7, 8] * 4, [5], temperature=1.0)]
    copies = lookup.propose(active, room=64)
    dspark = torch.randn(2, 4, 10)  # row 0 drafted with DSpark, row 1 copies
    logits = copy_logits(copies, dspark, [1.0, 1.0], vocab_size=10)
    assert logits.shape == (2, 6, 10) and torch.equal(logits[0, :4], dspark[0])
    q = torch.softmax(logits[1], dim=-1)
    assert torch.equal(q, torch.nn.functional.one_hot(torch.tensor([6, 7, 8, 5, 6, 7]), 10).float())


def test_config_rejects_a_negative_n():
    with pytest.raises(SchedulerConfigError, match="prompt_lookup"):
        SchedulerConfig("dspark", prompt_lookup=-1)
    with pytest.raises(SchedulerConfigError, match="lookup_tokens"):
        SchedulerConfig("dspark", lookup_tokens=0)
    assert SchedulerConfig("dspark").copies_prompts and SchedulerConfig("async").copies_prompts
    assert not SchedulerConfig("fixed").copies_prompts
    assert not SchedulerConfig("dspark", prompt_lookup=0).copies_prompts


# code with repeats, as the demo pair was trained on; its greedy continuations repeat too
PROMPT_TEXTS = ("    x = self.x\n    y = self.y\n    x = self.x\n    y = self.y\n",
                "def f(a):\n    return a\n\ndef g(a):\n    return a\n\ndef h(a):\n",
                "import os\nimport sys\nimport os\nimport sys\nimport")
PROMPTS = [Tokenizer.from_file(str(DEMO_TARGET / "tokenizer.json")).encode(text).ids for text in PROMPT_TEXTS]


@pytest.fixture(scope="module")
def pair():
    return load_pair(DEMO_TARGET, DEMO_DRAFTER)


def decode(pair, scheduler: SchedulerConfig, cost: CostTable, prompts=PROMPTS, new_tokens: int = 48,
           temperatures=None) -> tuple[list[list[int]], BatchEngine]:
    target, drafter = pair
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(len(prompts), 8192, 512), scheduler=scheduler, cost_model=cost,
                         kv_mode="concat")
    ids = [engine.submit(p, max_new_tokens=new_tokens, temperature=(temperatures or [0.0] * len(prompts))[i], seed=i)
           for i, p in enumerate(prompts)]
    done = engine.run_until_done()
    return [done[i].tokens for i in ids], engine


@pytest.mark.parametrize("mode", ["dspark", "async"])
def test_engine_greedy_output_is_the_targets_and_copies_are_used(pair, mode):
    plain, _ = decode(pair, SchedulerConfig("off"), device_table())
    single, engine = decode(pair, SchedulerConfig(mode, prompt_lookup=3), device_table(), prompts=PROMPTS[:1])
    assert single == plain[:1]
    assert engine.lookup.copies > 0 and engine.lookup.copies_accepted > engine.lookup.copies  # > 1 draft a copy
    copied = sum(len(s.copied_rows) for s in engine.stats.steps)
    assert copied == engine.lookup.copies
    assert engine.stats.summary()["copied_row_fraction"] == pytest.approx(copied / engine.steps_run)
    batched, engine = decode(pair, SchedulerConfig(mode, prompt_lookup=3), device_table())
    assert batched == plain
    assert engine.lookup.copies > 0


def test_long_copies_stay_lossless_and_fit_a_tight_kv_reservation(pair):
    """Copies up to twice the block: verified in one step, output still the target's; a request whose slot holds
    exactly what it reserves (prompt + new tokens + one block) never overflows it, however long copies may run."""
    target, drafter = pair
    gamma = drafter.config.block_size
    for new_tokens in (40, 24, 12):
        plain, _ = decode(pair, SchedulerConfig("off"), device_table(), prompts=PROMPTS[:1], new_tokens=new_tokens)
        engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                             capacity=Capacity(1, 4096, len(PROMPTS[0]) + new_tokens + gamma + 1),
                             scheduler=SchedulerConfig("dspark", prompt_lookup=3), cost_model=device_table(),
                             kv_mode="concat")
        rid = engine.submit(PROMPTS[0], max_new_tokens=new_tokens)
        assert engine.run_until_done()[rid].tokens == plain[0]
        if new_tokens == 40:
            longest = max(max(s.lengths) for s in engine.stats.steps if s.copied_rows)
            assert gamma < longest <= 2 * gamma


def test_a_request_whose_copies_fail_stops_copying(pair, monkeypatch):
    _, honest = decode(pair, SchedulerConfig("dspark", prompt_lookup=3), device_table(), prompts=PROMPTS[:1],
                       new_tokens=96)
    vocab = pair[0].config.vocab_size
    # every copy a wrong token: each costs a step that verifies nothing, so p must fall and copies stop
    monkeypatch.setattr(LookupState, "continuation",
                        lambda self, prompt, tokens, limit: [(tokens[-1] + 1 + k) % vocab for k in range(limit)])
    wrong, engine = decode(pair, SchedulerConfig("dspark", prompt_lookup=3), device_table(), prompts=PROMPTS[:1],
                           new_tokens=96)
    plain, _ = decode(pair, SchedulerConfig("off"), device_table(), prompts=PROMPTS[:1], new_tokens=96)
    assert wrong == plain  # lossless whatever is copied
    steps = engine.steps_run
    assert engine.lookup.copies_accepted <= engine.lookup.copies // 4  # (a wrong copy may still be right)
    assert engine.lookup.copies <= steps // 4, (engine.lookup.copies, steps)  # measured: 3 of 26 steps
    assert honest.lookup.copies / honest.steps_run >= 2 * engine.lookup.copies / steps  # measured: 11 of 18


def test_no_copies_where_the_gate_declines_drafting(pair):
    table = device_table()
    slow = CostTable(table.batches, table.buckets, table.verify, tuple(100 * d for d in table.draft))
    _, engine = decode(pair, SchedulerConfig("dspark", prompt_lookup=3), slow)
    drafted = [s for s in engine.stats.steps if s.confidence_logits is not None]
    assert engine.lookup.copies == 0 and len(drafted) <= 2 + engine.steps_run // 16  # probes alone drafted


def test_sampling_rows_decode_beside_copying_greedy_rows(pair):
    temperatures = [0.0, 1.0, 0.0]
    plain, _ = decode(pair, SchedulerConfig("off"), device_table())
    mixed, engine = decode(pair, SchedulerConfig("dspark", prompt_lookup=3), device_table(), temperatures=temperatures)
    assert mixed[0] == plain[0] and mixed[2] == plain[2] and len(mixed[1]) == 48
    assert engine.lookup.copies > 0
    assert np.all(np.array([len(t) for t in mixed]) == 48)


EVERY_TOKEN = list(range(VOCAB))  # a prompt where the first sampled token always matches (n = 1)


def sampled_copy_counts(target, drafter, requests: int, mode: str = "dspark") -> tuple[torch.Tensor, int]:
    """`requests` seeded T = 1 requests of 3 new tokens, every one copying wherever its history has a match
    (n = 1; the DSpark side weighs nothing, verification nearly free) -> counts of (t2, t3) [V, V], copies."""
    vocab = target.config.vocab_size
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(128, 128 * 16, 16),
                         scheduler=SchedulerConfig(mode, prompt_lookup=1, gate_drafting=False),
                         cost_model=StepCostModel(1e-3, 0.0, 1e-9))
    engine.lookup.dspark_accepts = 0.0
    ids = [engine.submit(EVERY_TOKEN, max_new_tokens=3, temperature=1.0, seed=s) for s in range(requests)]
    finished = engine.run_until_done()
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for i in ids:
        counts[finished[i].tokens[1], finished[i].tokens[2]] += 1
    return counts, engine.lookup.copies


@pytest.mark.parametrize("mode", ["dspark", "async"])
def test_sampled_copies_keep_the_targets_law_and_a_wrong_q_is_caught(monkeypatch, mode):
    target, drafter = small_pair()
    law = exact_law_of_tokens_2_and_3(target, 1.0, EVERY_TOKEN)
    counts, copies = sampled_copy_counts(target, drafter, 4000, mode)
    assert copies > 1000  # most requests verified a copy for (t2, t3)
    assert pooled_pvalue(counts, law) > 1e-3
    # the control: copies verified as if drawn uniformly (q = 1/V) instead of copied (q = 1 on the copy)
    monkeypatch.setattr(prompt_lookup, "copy_logits", lambda copies, logits, temperatures, vocab_size: torch.zeros(
        (*copies.tokens.shape, vocab_size)))
    wrong, _ = sampled_copy_counts(target, drafter, 4000, mode)
    assert pooled_pvalue(wrong, law) < 1e-6


def test_a_long_copy_beside_a_row_near_its_slot_end_fits_the_padded_batch(pair):
    """Verification is padded to the widest row: a copy longer than a block widens every row, so it is cut to
    what the fullest row's slot still holds (every row's reservation covers one block past its output)."""
    target, drafter = pair
    gamma = drafter.config.block_size
    prompts = [PROMPTS[2], PROMPTS[0][:5]]  # the first row's slot fills first: its prompt is the longer
    new_tokens = 64
    plain, _ = decode(pair, SchedulerConfig("off"), device_table(), prompts=prompts, new_tokens=new_tokens)
    engine = BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                         capacity=Capacity(2, 4096, len(prompts[0]) + new_tokens + gamma + 1),
                         scheduler=SchedulerConfig("dspark", prompt_lookup=3), cost_model=device_table(),
                         kv_mode="concat")
    ids = [engine.submit(p, max_new_tokens=new_tokens) for p in prompts]
    done = engine.run_until_done()
    assert [done[i].tokens for i in ids] == plain
    assert any(max(s.lengths) > gamma for s in engine.stats.steps if s.copied_rows)  # long copies were made
