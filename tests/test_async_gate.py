"""The asynchronous scheduler (§5.2) under padded verification and behind the drafting gate: the depth
search, capacities kept per drafting row, and the gate deciding which rows draft in mode `async`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_drafting_gate import CHEAP, DEAR, GAMMA, SplitCost
from test_drafting_gate_engine import drafted_rows, greedy, launches, pair, prompts, run

from dspark.runtime.async_scheduler import AsyncScheduler, best_depth
from dspark.runtime.batch_loop import BatchEngine
from dspark.runtime.capacity import Capacity
from dspark.runtime.model_info import ModelInfo
from dspark.runtime.prefix_scheduler import SchedulerConfig
from dspark.runtime.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread", "probes_whatever_the_ceiling")


def jagged(requests, tokens):
    return 1e-3 + 2e-4 * requests + 3e-3 * np.ceil(np.asarray(tokens, dtype=np.float64) / 8)


def linear(requests, tokens):
    return 1e-3 + 1e-4 * np.asarray(tokens, dtype=np.float64)


def survivals(rng: np.random.Generator, rows: int, drafting: int | None = None, low: float = 0.3) -> np.ndarray:
    """[rows, γ] non-increasing survival rows; rows past `drafting` did not draft (survival 0)."""
    a = np.cumprod(rng.uniform(low, 1.0, (rows, GAMMA)), axis=1)
    if drafting is not None:
        a[drafting:] = 0.0
    return a


def logits_of(a: np.ndarray) -> torch.Tensor:
    """Confidence logits whose survival (no temperatures) is `a`; rows of zeros: −inf (did not draft)."""
    ratio = np.divide(a, np.concatenate((np.ones((len(a), 1)), a[:, :-1]), axis=1), out=np.zeros_like(a),
                      where=a > 0)
    with np.errstate(divide="ignore"):
        return torch.from_numpy(np.log(ratio) - np.log1p(-np.minimum(ratio, 1 - 1e-12)))


def test_best_depth_is_the_argmax_over_depths_of_rows_like_those_that_drafted():
    rng = np.random.default_rng(0)
    for trial in range(200):
        rows = int(rng.integers(1, 20))
        drafting = int(rng.integers(1, rows + 1))
        a = survivals(rng, rows, drafting)
        slope = rng.uniform(1e-5, 1e-3)
        cost = (lambda r, b, s=slope: 1e-3 + s * np.ceil(np.asarray(b, dtype=np.float64) / 4)) if trial % 2 else jagged
        drafted = a[:drafting]
        thetas = [rows * (1 + drafted[:, :d].sum(axis=1).mean()) / float(cost(rows, rows * (1 + d)))
                  for d in range(GAMMA + 1)]
        assert best_depth(a, cost) == int(np.argmax(thetas))


def test_a_probe_of_a_few_rows_stands_for_every_row_like_them():
    rng = np.random.default_rng(1)
    for _ in range(50):
        row = survivals(rng, 1)
        every = np.repeat(row, 16, axis=0)
        probe = every.copy()
        probe[4:] = 0.0  # 4 of 16 rows drafted, like the rest would have
        assert best_depth(probe, jagged) == best_depth(every, jagged)


def test_padded_async_admits_every_rows_candidates_up_to_the_depth_of_two_decisions_back():
    rng = np.random.default_rng(2)
    sched = AsyncScheduler(padded=True)
    history = []
    for t in range(12):
        rows = int(rng.integers(2, 9))
        a = survivals(rng, rows, drafting=rows - int(t % 3 == 0))  # now and then a row has no draft
        decision = sched.decide(confidence_logits=logits_of(a), step_seconds=jagged)
        history.append(best_depth(a, jagged))
        if t >= 2:
            expected = np.minimum(history[t - 2], (a > 0).sum(axis=1))
            assert list(decision.lengths) == expected.tolist()
            assert sched.capacity(5) == 5 * history[t - 1]  # the next decision's depth, for 5 rows


def test_packed_capacity_is_kept_per_drafting_row():
    """A probe (2 of 8 rows drafted) finds K*; two decisions later all 8 rows draft and admit K*·8/2."""
    rng = np.random.default_rng(3)
    sched = AsyncScheduler()
    probe = survivals(rng, 8, drafting=2, low=0.85)
    sched.decide(confidence_logits=logits_of(probe), step_seconds=linear)
    k_star = sched._searched[-1][0]
    assert 0 < 4 * k_star < (probe > 0).sum() * 4  # some candidates pay, not all
    sched.decide(confidence_logits=logits_of(survivals(rng, 8)), step_seconds=linear)
    assert sched.capacity(8) == 4 * k_star
    every = survivals(rng, 8, low=0.85)
    decision = sched.decide(confidence_logits=logits_of(every), step_seconds=linear)
    assert sum(decision.lengths) == 4 * k_star


def async_engine(cost: SplitCost, slots: int = 6, pricing: str = "padded", overlap: bool = False) -> BatchEngine:
    target, drafter = pair()
    # no prompt-lookup copies: the gate's choices alone (a copying row is no drafting row; test_prompt_lookup)
    scheduler = SchedulerConfig("async", pricing=pricing, overlap_probes=overlap, prompt_lookup=0)
    return BatchEngine(TorchBackend(target, drafter), ModelInfo.from_models(target, drafter),
                       capacity=Capacity(slots, 1 << 16, 1024), scheduler=scheduler, cost_model=cost, kv_mode="concat")


@pytest.mark.parametrize("pricing", ["padded", "packed", "padded-overlapped"])
@pytest.mark.parametrize(("cost", "kinds"), [(DEAR, {"p", "."}), (CHEAP, {"A"})], ids=["skip-and-probe", "draft"])
def test_the_gate_decides_who_drafts_in_async_mode_and_greedy_stays_the_targets(cost, kinds, pricing):
    overlap = pricing.endswith("-overlapped")  # probes drafted on the worker: their launches show them
    pricing = pricing.removesuffix("-overlapped")
    engine = async_engine(cost, pricing=pricing, overlap=overlap)
    launched = launches(engine)
    assert engine.gate is not None
    p = list(prompts())
    new = 32
    asked = run(engine, {0: p[:3], 2: p[3:5], 5: p[5:7], 11: p[7:10]}, new)
    finished = engine.take_finished()
    assert len(finished) == len(asked) == 10
    for request_id, prompt in asked.items():
        assert finished[request_id].tokens == greedy(prompt, new)
    steps = [s for s in engine.stats.steps if s.requests > engine.gate.probe_rows]
    seen = {"A" if s.drafted else "p" if drafted_rows(s) else "." for s in steps}
    assert seen | ({"p"} if launched else set()) == kinds and bool(launched) == (overlap and "p" in kinds)
    verified = sum(max(s.lengths) for s in steps if drafted_rows(s))
    if kinds == {"A"} or pricing == "packed":
        assert verified > 0  # the async decisions verified drafts
    else:
        assert verified == 0  # a probe under padded verification verifies anchors only
