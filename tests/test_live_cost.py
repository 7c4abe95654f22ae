"""The live step cost model: it follows the load the engine measures, robustly and within a bounded
number of steps, and moves the schedule when relative costs change; then comes back."""

from __future__ import annotations

import gc
from collections import OrderedDict, deque
from dataclasses import dataclass
from statistics import median

import numpy as np
import pytest

from dspark.runtime import live_cost
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.drafting_gate import SplitStepCost
from dspark.runtime.live_cost import LIMIT, LiveStepCost, bucket
from dspark.runtime.stats import StepRecord

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass(frozen=True)
class Split:
    """draft(R) = 1 ms·R; verify(R, B) = 2 ms + 0.1 ms·B (as a whole step: StepCostModel(2e-3, 1e-3, 1e-4))."""

    def draft_seconds(self, requests: int) -> float:
        return 1e-3 * requests

    def verify_seconds(self, requests: int, tokens):
        return 2e-3 + 1e-4 * tokens

    def seconds(self, requests: int, tokens):
        return self.draft_seconds(requests) + self.verify_seconds(requests, tokens)

    def to_dict(self) -> dict[str, str]:
        return {"kind": "split"}


PRIOR = Split()


def record(requests: int, tokens: int, *, draft: float = 1.0, verify: float = 1.0, prefill: float = 0.0,
           commit: float = 0.0, drafted: bool = True) -> StepRecord:
    """A step whose drafting took `draft`× and whose verification took `verify`× what PRIOR says."""
    seconds = {"prefill": prefill, "schedule": 0.0, "verify": verify * PRIOR.verify_seconds(requests, tokens),
               "commit": commit}
    if drafted:
        drafting = draft * PRIOR.draft_seconds(requests)
        seconds.update(draft=0.75 * drafting, heads=0.25 * drafting)
    return StepRecord(step=0, requests=requests, admitted_new=0, lengths=[tokens // max(requests, 1) - 1] * requests,
                      verified_tokens=tokens, padded_tokens=tokens, acceptance_lengths=[1] * requests,
                      expected_accepts=None, predicted_seconds=None, seconds=seconds, drafted=drafted)


def factor(live: LiveStepCost, requests: int = 4, tokens: int = 16) -> float:
    return float(live.seconds(requests, tokens)) / PRIOR.seconds(requests, tokens)


def steps_until(live: LiveStepCost, step: StepRecord, done, limit: int = 100) -> int:
    for n in range(1, limit + 1):
        live.observe(step)
        if done(factor(live)):
            return n
    return limit + 1


def test_the_prior_until_steps_are_seen_and_its_interface_kept():
    live = LiveStepCost(PRIOR)
    tokens = np.arange(4, 40)
    np.testing.assert_allclose(live.seconds(4, tokens), PRIOR.seconds(4, tokens))
    assert live.seconds(4, 16) == pytest.approx(PRIOR.seconds(4, 16))
    assert isinstance(live, SplitStepCost) and live.draft_seconds(4) == pytest.approx(PRIOR.draft_seconds(4))
    assert live.to_dict()["prior"] == {"kind": "split"} and live.load_factor == 1.0
    whole = LiveStepCost(StepCostModel(1e-3, 1e-4, 1e-4))
    assert not isinstance(whole, SplitStepCost)  # no drafting gate over a prior that cannot price it
    assert LiveStepCost(live).prior is PRIOR  # one live layer, not two


def test_a_slowdown_is_followed_within_bounded_steps_and_undone_as_fast():
    live = LiveStepCost(PRIOR)  # horizon 32 steps
    for _ in range(40):
        live.observe(record(4, 16))
    slow = steps_until(live, record(4, 16, draft=2.0, verify=2.0), lambda f: f > 1.9)
    assert 2 <= slow <= 17  # not one step (that could be a hiccup), and within horizon/2 + 1
    for _ in range(17 - slow):
        live.observe(record(4, 16, draft=2.0, verify=2.0))
    assert live.load_factor == pytest.approx(2.0)  # every cell's fallback too, after horizon/2 + 1
    back = steps_until(live, record(4, 16), lambda f: f < 1.1)
    assert 2 <= back <= 17


def test_plain_steps_are_learned_one_in_plain_stride_and_a_slowdown_of_them_still_followed():
    """Plain steps (no drafting, B = R) like the last learned are learned one in PLAIN_STRIDE (each learned step was
    ~8 µs of a ~0.45 ms one-request step): the clock counts them all, and a slowdown of plain decoding is followed
    within horizon/2 + PLAIN_STRIDE steps; drafting steps are all learned."""
    live = LiveStepCost(PRIOR)  # horizon 32 steps
    for _ in range(32):  # (within the horizon: none aged out)
        live.observe(record(4, 4, drafted=False))
    assert live.verify_seconds(4, 4) == pytest.approx(PRIOR.verify_seconds(4, 4))
    plain_cell = live.verify_ratios.cells[bucket(4), bucket(4)]
    assert live.steps == 32 and len(plain_cell) == 32 // live_cost.PLAIN_STRIDE
    for _ in range(8):
        live.observe(record(4, 16))
    live.verify_seconds(4, 16)
    assert len(live.verify_ratios.cells[bucket(4), bucket(16)]) == 8  # drafting steps: every one
    followed = 0
    while followed < 40 and live.verify_seconds(4, 4) <= 1.9 * PRIOR.verify_seconds(4, 4):
        live.observe(record(4, 4, verify=2.0, drafted=False))
        followed += 1
    assert 2 <= followed <= 16 + live_cost.PLAIN_STRIDE


def test_outliers_do_not_move_it():
    live = LiveStepCost(PRIOR)
    for i in range(200):
        pause = 20.0 if i % 5 == 0 else 1.0  # one step in five preempted or collecting garbage
        live.observe(record(4, 16, draft=pause, verify=pause))
        if i > 10:
            assert factor(live) == pytest.approx(1.0, rel=0.01)


def test_one_odd_step_in_a_cell_is_not_its_cost():
    live = LiveStepCost(PRIOR)
    for _ in range(20):
        live.observe(record(4, 16))
    live.observe(record(4, 64, verify=10.0))  # a cell seen once, in a hiccup
    assert live.verify_seconds(4, 64) == pytest.approx(PRIOR.verify_seconds(4, 64))


@pytest.mark.parametrize("prior", [PRIOR, StepCostModel(2e-3, 1e-3, 1e-4)], ids=["split", "whole-step"])
def test_prefill_and_idle_steps_do_not_count(prior):
    live = LiveStepCost(prior)
    for _ in range(20):
        live.observe(record(4, 16, prefill=1.0))
        live.observe(record(0, 0, prefill=1.0))
    assert live.seconds(4, 16) == pytest.approx(prior.seconds(4, 16)) and live.steps == 20
    assert live.load_factor == pytest.approx(1.0)


def test_drafting_verification_and_overhead_are_learned_apart():
    live = LiveStepCost(PRIOR)
    for _ in range(20):
        live.observe(record(4, 16, draft=3.0, verify=1.0, commit=5e-4))
    assert live.draft_seconds(4) == pytest.approx(3 * PRIOR.draft_seconds(4))
    tokens = np.array([4, 8, 16, 32, 64])  # seen at 16: the overhead is per step, not per token
    np.testing.assert_allclose(live.verify_seconds(4, tokens), PRIOR.verify_seconds(4, tokens) + 5e-4)


def test_cells_where_seen_and_the_load_factor_elsewhere():
    live = LiveStepCost(PRIOR)
    for _ in range(10):
        live.observe(record(4, 8, verify=1.0, draft=1.0))
        live.observe(record(4, 32, verify=2.0, draft=1.0))
    verify = live.verify_seconds(4, np.array([8, 16, 32, 64])) / PRIOR.verify_seconds(4, np.array([8, 16, 32, 64]))
    np.testing.assert_allclose(verify, [1.0, 1.5, 2.0, 2.0])  # along B: between the cells seen, flat past them
    assert live.verify_seconds(64, 200) / PRIOR.verify_seconds(64, 200) == pytest.approx(1.5)  # median of all
    assert [float(live.seconds(4, b)) for b in range(4, 40)] == pytest.approx(list(live.seconds(4, np.arange(4, 40))))


def test_drafting_seen_only_at_probes_still_follows_them():
    """While the gate skips drafting, a probe every 16 steps is all there is: the draft factor
    follows the latest probes (2 of 3) rather than ratios from before the change."""
    live = LiveStepCost(PRIOR)
    for _ in range(20):
        live.observe(record(4, 28, draft=2.0))
    probes = 0
    while live.draft_seconds(4) > 1.1 * PRIOR.draft_seconds(4):
        for _ in range(15):
            live.observe(record(4, 4, drafted=False))
        live.observe(record(4, 28))
        probes += 1
    assert probes == 2


def test_memory_is_bounded():
    live = LiveStepCost(PRIOR, max_cells=64)
    g = np.random.default_rng(0)
    for _ in range(3000):
        requests = int(g.integers(1, 1025))
        tokens = requests * int(g.integers(1, 9))
        live.observe(record(requests, tokens, draft=g.uniform(0.5, 2), verify=g.uniform(0.5, 2)))
    for cells in (live.step_ratios, live.draft_ratios, live.verify_ratios, live.overhead):
        assert len(cells.cells) <= 64 and all(len(v) <= cells.window for v in cells.cells.values())
        assert len(cells.recent) <= 32


class Uncached:
    """The model as the module docstring states it, recomputed from the raw history at every price
    (no tables, no kept medians): the oracle for LiveStepCost's caches."""

    def __init__(self, prior, *, window: int = 16, horizon: int = 32, min_samples: int = 3, max_cells: int = 256):
        self.prior, self.window, self.horizon, self.min_samples, self.max_cells = (prior, window, horizon,
                                                                                   min_samples, max_cells)
        self.split, self.steps = isinstance(prior, SplitStepCost), 0
        self.cells = {name: OrderedDict() for name in ("step", "draft", "verify", "overhead")}
        self.recent = {name: deque(maxlen=max(horizon, min_samples)) for name in self.cells}

    def add(self, name: str, requests: int, tokens: int, value: float) -> None:
        cell = (bucket(requests), bucket(tokens))
        values = self.cells[name].pop(cell, None) or deque(maxlen=self.window)
        values.append((self.steps, value))
        self.cells[name][cell] = values
        if len(self.cells[name]) > self.max_cells:
            self.cells[name].popitem(last=False)
        self.recent[name].append((self.steps, value))

    def observe(self, step: StepRecord) -> None:
        if step.requests < 1:
            return
        self.steps += 1
        r, b, seconds = step.requests, step.verified_tokens, step.seconds

        def ratio(name: str, spent: float, prior: float, tokens: int) -> None:
            if spent > 0 and prior > 1e-9:
                self.add(name, r, tokens, spent / prior)

        if not self.split:
            ratio("step", step.total_seconds - seconds["prefill"], float(self.prior.seconds(r, b)), b)
            return
        draft = self.prior.draft_seconds(r) if step.drafted else 0.0
        ratio("step", step.total_seconds - seconds["prefill"], float(draft + self.prior.verify_seconds(r, b)), b)
        ratio("verify", seconds["verify"], float(self.prior.verify_seconds(r, b)), b)
        self.add("overhead", r, 0, seconds["commit"] + (0.0 if step.drafted else seconds["schedule"]))
        if step.drafted:
            ratio("draft", sum(seconds.get(p, 0.0) for p in ("draft", "heads", "schedule")),
                  float(self.prior.draft_seconds(r)), 0)

    def at(self, name: str, requests: int, tokens=0):
        def fresh(entries):
            return [v for t, v in entries if self.steps - t < self.horizon]

        points = sorted((b, median(f)) for (r, b), entries in self.cells[name].items()
                        if r == bucket(requests) and len(f := fresh(entries)) >= self.min_samples)
        if points:
            return np.interp(bucket(tokens), [b for b, _ in points], [m for _, m in points])
        level = fresh(self.recent[name])
        if len(level) < self.min_samples:
            level = [v for _, v in list(self.recent[name])[-self.min_samples:]]
        return np.full(np.shape(tokens), median(level) if level else 0.0 if name == "overhead" else 1.0)

    def draft_seconds(self, requests: int) -> float:
        return float(self.prior.draft_seconds(requests)) * float(self.at("draft", requests))

    def verify_seconds(self, requests: int, tokens):
        scaled = self.prior.verify_seconds(requests, tokens) * self.at("verify", requests, tokens)
        return np.maximum(scaled + float(self.at("overhead", requests)), 1e-9)

    def seconds(self, requests: int, tokens):
        if not self.split:
            return np.maximum(self.prior.seconds(requests, tokens) * self.at("step", requests, tokens), 1e-9)
        return np.maximum(self.draft_seconds(requests) + self.verify_seconds(requests, tokens), 1e-9)


@dataclass(frozen=True)
class Scaled:
    """`inner`, every part `by`× (a prior swapped in mid-run)."""

    inner: Split | StepCostModel
    by: float

    def draft_seconds(self, requests: int) -> float:
        return self.by * self.inner.draft_seconds(requests)

    def verify_seconds(self, requests: int, tokens):
        return self.by * self.inner.verify_seconds(requests, tokens)

    def seconds(self, requests: int, tokens):
        return self.by * self.inner.seconds(requests, tokens)


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole-step"])
def test_cached_prices_equal_the_model_recomputed_from_scratch(split, monkeypatch):
    """Random observation sequences (load changes, plain and idle steps, few and many cells, cells evicted,
    values ageing out while nothing is priced, a machine so fast that prices floor at 1 ns, a prior swapped
    in mid-step): every price the engine asks for equals the uncached model's, to 1e-12 (prices rebuilt at
    every observation: what they are rebuilt from, not how often)."""
    monkeypatch.setattr(live_cost, "PRICE_REFRESH", 1)
    g = np.random.default_rng(7)

    def check(r: int) -> None:
        tokens = r + np.arange(8 * r + 1)
        for asked in (tokens, tokens[::-1], np.array([r]), int(tokens[-1]), round(r * 1.7), 64, tokens + 0.5,
                      np.array([40 * r + 1000, r]), np.array([2 * r, -1]), LIMIT + 3):
            np.testing.assert_allclose(live.seconds(r, asked), reference.seconds(r, asked), rtol=1e-12, atol=0)
            if split:
                np.testing.assert_allclose(live.verify_seconds(r, asked), reference.verify_seconds(r, asked),
                                           rtol=1e-12, atol=0)
        if split:
            assert live.draft_seconds(r) == pytest.approx(reference.draft_seconds(r), rel=1e-12, abs=0)

    for trial, speed in enumerate((1.0, 1.0, 1e-7)):  # seconds the machine takes per second of the prior
        prior = PRIOR if split else StepCostModel(2e-3, 1e-3, 1e-4)
        live, reference = LiveStepCost(prior, max_cells=12 + 40 * trial), Uncached(prior, max_cells=12 + 40 * trial)
        assert isinstance(live, SplitStepCost) == split
        for step in range(200):
            requests = int(g.choice([1, 1, 2, 3, 8, 64]))
            load = speed * (3.0 if (step // 60) % 2 else 1.0)
            step_record = record(requests, requests * int(g.integers(1, 9)), draft=load * g.uniform(0.7, 1.4),
                                 verify=speed * g.uniform(0.8, 1.3), commit=speed * g.uniform(0, 1e-3),
                                 drafted=g.random() < 0.8, prefill=g.choice([0.0, 0.01]))
            step_record = step_record if g.random() < 0.95 else record(0, 0)  # or an idle step
            live.observe(step_record)
            reference.observe(step_record)
            if g.random() < 0.3:  # steps go by unpriced: cells age out between prices
                continue
            for r in {requests, int(g.choice([1, 4, 64]))}:
                check(r)
            if step >= 150 and not isinstance(live.prior, Scaled):  # a new prior, priced by at once
                live.prior = reference.prior = Scaled(live.prior, 1.5)
                check(requests)


def test_prices_move_every_price_refresh_observations_and_are_then_the_models():
    """A rebuild costs ~27 µs (one request's step: ~2.8 ms), so prices follow the observations every
    `PRICE_REFRESH` of them: unchanged in between, the uncached model's right after."""
    g = np.random.default_rng(3)
    live, reference = LiveStepCost(PRIOR), Uncached(PRIOR)
    moves = []
    before = live.seconds(4, 16)
    for step in range(1, 41):
        observed = record(4, 16, draft=g.uniform(0.5, 2.0), verify=g.uniform(0.5, 2.0))
        live.observe(observed)
        reference.observe(observed)
        price = live.seconds(4, 16)
        if price != before:
            moves.append(step)
        if step % live_cost.PRICE_REFRESH == 0:
            assert price == pytest.approx(reference.seconds(4, 16), rel=1e-12, abs=0)
        before = price
    assert moves and all(step % live_cost.PRICE_REFRESH == 0 for step in moves)


def test_live_models_over_one_prior_table_it_once_while_it_lives():
    """An engine's first step tabled its prior afresh (~0.3 ms of a 2 ms step): live models over one prior share
    the tables, a split and a whole-step reading of it apart, and they go with the prior."""
    prior = Split()
    first, second = LiveStepCost(prior), LiveStepCost(prior)
    assert first.seconds(4, 16) == pytest.approx(second.seconds(4, 16))
    assert first._tables is second._tables and 4 in first._tables
    whole = live_cost.LiveStepCost.__new__(live_cost.LiveStepCost)  # the whole-step reading of a split prior
    whole.__init__(prior)
    assert whole._tables is not first._tables
    other = LiveStepCost(Split())
    assert other._tables is not first._tables
    assert other.seconds(4, 16) == pytest.approx(first.seconds(4, 16))
    key = (id(prior), True)
    assert key in live_cost._PRIOR_TABLES
    del prior, first, second, whole
    gc.collect()
    assert key not in live_cost._PRIOR_TABLES


def test_steps_learned_when_a_price_is_read_price_as_steps_learned_at_once():
    """`observe` queues a step (its host caches are cold right after the graphs); a price or a factor read after any
    number of queued steps is the one a model that learned each step at once gives, and queued steps stay bounded."""
    every, lazily = LiveStepCost(PRIOR), LiveStepCost(PRIOR)
    rng = np.random.default_rng(0)
    steps = [record(int(r), int(r) * int(w), draft=float(d), verify=float(v), drafted=bool(k))
             for r, w, d, v, k in zip(rng.integers(1, 9, 300), rng.integers(1, 5, 300), rng.uniform(0.5, 3, 300),
                                      rng.uniform(0.5, 3, 300), rng.integers(0, 2, 300), strict=True)]
    for n, step in enumerate(steps):
        every.observe(step)
        every._catch_up()  # learned at once, as before the queue
        lazily.observe(step)
        assert len(lazily._unseen) < live_cost.UNSEEN_LIMIT
        if n % 100 == 99:  # read now and then (more steps between than are ever queued)
            assert lazily.seconds(4, 16) == every.seconds(4, 16)
            assert lazily.verify_seconds(int(step.requests), 7) == every.verify_seconds(int(step.requests), 7)
    assert lazily.draft_seconds(3) == every.draft_seconds(3) and lazily.to_dict() == every.to_dict()
