"""The drafting gate alone: decisions from the prior table at the first step, probes over a few rows, catch-up
priced by its share, what the cost model learns (the engine's side: test_drafting_gate_engine.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dspark.runtime import probe_spacing
from dspark.runtime.drafter_runner import CONTEXT_ROW_COST, split_calls
from dspark.runtime.drafting_gate import (
    CLEAR_DECLINE_STEPS,
    DECLINE_STEPS,
    MAX_ACCEPTANCE_SCALE,
    DraftingGate,
    GatePlan,
)
from dspark.runtime.prefix_scheduler import prefix_schedule, survival
from dspark.runtime.probe_spacing import (
    FULL_PROBE_EVERY,
    MAX_FULL_PROBE_BACKOFF,
    MAX_PROBE_BACKOFF,
    SLOW_DRAFTER,
    THIN_POOL_ROWS,
)
from dspark.runtime.stats import StepRecord

pytestmark = pytest.mark.usefixtures("one_thread", "probes_whatever_the_ceiling")

GAMMA = 7  # the golden pair's block size


@dataclass(frozen=True)
class SplitCost:
    """draft(R) = draft_per_request·R; verify(R, B) = 1 ms + per_token·B."""

    draft_per_request: float
    per_token: float

    def draft_seconds(self, requests: int) -> float:
        return self.draft_per_request * requests

    def verify_seconds(self, requests: int, tokens):
        return 1e-3 + self.per_token * tokens

    def seconds(self, requests: int, tokens):
        return self.draft_seconds(requests) + self.verify_seconds(requests, tokens)

    def to_dict(self) -> dict[str, float]:
        return {"draft_per_request": self.draft_per_request, "per_token": self.per_token}


SHARE = 0.05  # PROBE_SHARE where a test's numbers are worked out for a share (its own default may move)
CHEAP = SplitCost(draft_per_request=1e-6, per_token=1e-5)  # drafting always pays
DEAR = SplitCost(draft_per_request=1.0, per_token=1e-4)  # drafting never pays


def confident(rows: int, logit: float = 3.0) -> torch.Tensor:
    return torch.full((rows, GAMMA), logit)


# -- the gate alone ------------------------------------------------------------------------------
def test_first_step_probes_the_cheapest_rows_when_the_table_says_drafting_cannot_pay(monkeypatch):
    monkeypatch.setattr(probe_spacing, "PROBE_SHARE", 1e9)  # probes as often as probe_every allows
    backlogs = np.array([30, 5, 40, 5, 9, 12, 7, 50])
    assert DraftingGate(DEAR, block_size=GAMMA).plan(backlogs).rows.tolist() == [1]  # by default one row probes
    gate = DraftingGate(DEAR, block_size=GAMMA, probe_rows=4)
    plan = gate.plan(backlogs)
    assert plan.probe and plan.rows.tolist() == [1, 3, 4, 6]  # the 4 smallest backlogs, nobody else
    gate.record(plan, confident(8))
    for _ in range(gate.probe_every):
        plan = gate.plan(backlogs)
        assert not len(plan.rows)  # plain decoding ...
        gate.record(plan, None)
    assert gate.plan(backlogs).rows.tolist() == [1, 3, 4, 6]  # ... until the next probe, of 4 rows again
    # never more than half the rows (rounded up), so the others' anchors verify alone: one request probes itself
    assert DraftingGate(DEAR, block_size=GAMMA, probe_rows=4).plan(backlogs[:3]).rows.tolist() == [0, 1]
    assert DraftingGate(DEAR, block_size=GAMMA, probe_rows=4).plan(backlogs[:1]).all


def probe_gaps(gate: DraftingGate, backlogs: np.ndarray, took: float = 0.0) -> list[int]:
    """Steps between the first 7 probes of 120 steps, each measured to have drafted for `took` seconds."""
    probes = []
    for step in range(120):
        plan = gate.plan(backlogs)
        if len(plan.rows):
            probes.append(step)
        gate.record(plan, confident(len(backlogs)) if len(plan.rows) else None, drafting_seconds=took)
    return [b - a for a, b in pairwise(probes)][:6]


def test_probes_back_off_while_drafting_does_not_pay_and_come_back_once_it_does(monkeypatch):
    """Gaps between probes double from probe_every to MAX_PROBE_BACKOFF·probe_every while every probe finds
    drafting unprofitable; a step that drafts every row puts them back to probe_every. (Probes here cost
    nothing against the plain steps between them: the next test is about that.)"""
    monkeypatch.setattr(probe_spacing, "PROBE_SHARE", 1e9)
    backlogs = np.array([30, 5, 40, 5, 9, 12, 7, 50])

    def gaps(gate: DraftingGate) -> list[int]:
        return probe_gaps(gate, backlogs)

    intervals = [min(2 << k, MAX_PROBE_BACKOFF * 2) for k in range(6)]  # 2, 4, 8, 16, 16, 16
    assert gaps(DraftingGate(DEAR, block_size=GAMMA, probe_every=2)) == [i + 1 for i in intervals]  # + the probe
    # a live cost model that finds the drafter slowed: the decline may pass, and probes keep measuring it
    slowed = SimpleNamespace(draft_seconds=DEAR.draft_seconds, verify_seconds=DEAR.verify_seconds,
                             draft_factor=SLOW_DRAFTER)
    assert gaps(DraftingGate(slowed, block_size=GAMMA, probe_every=2)) == [3] * 6
    gate = DraftingGate(DEAR, block_size=GAMMA, probe_every=2)
    gaps(gate)
    assert gate.probe_interval == MAX_PROBE_BACKOFF * gate.probe_every
    gate.cost = CHEAP  # drafting pays now: every row drafts, and a later decline probes at probe_every again
    plans = [gate.plan(backlogs) for _ in range(DECLINE_STEPS + 1)]  # a decline is reused a few steps
    assert plans[-1].all and gate.probe_interval == gate.probe_every


def test_a_probe_of_a_few_rows_waits_until_the_plain_steps_have_paid_for_it(monkeypatch):
    """After a probe of a few rows, the next waits until the plain steps since have cost its price over
    PROBE_SHARE (at most the longest backoff), or the doubling interval if that is longer; not while the drafter
    is found slowed."""
    monkeypatch.setattr(probe_spacing, "PROBE_SHARE", SHARE)
    cost = SplitCost(draft_per_request=9e-4, per_token=1e-4)  # a probe 0.9 ms, a plain step of 8 rows 1.8 ms
    backlogs = np.full(8, 5)  # no catch-up: a probe's price is draft(1)
    gate = DraftingGate(cost, block_size=GAMMA, probe_every=2)
    spacing = math.ceil(cost.draft_seconds(1) / (SHARE * cost.verify_seconds(8, 8)))
    assert 2 < spacing < MAX_PROBE_BACKOFF * 2  # between the first interval and the longest backoff
    intervals = [max(min(2 << k, MAX_PROBE_BACKOFF * 2), spacing) for k in range(6)]
    assert probe_gaps(gate, backlogs) == [i + 1 for i in intervals]  # (without the wait: 3, 5, 9, 17, 17, 17)
    # a probe that took longer than its price is spaced by what it took
    took = 1.5 * cost.draft_seconds(1)
    longer = math.ceil(took / (SHARE * cost.verify_seconds(8, 8)))
    assert spacing < longer < MAX_PROBE_BACKOFF * 2
    assert probe_gaps(DraftingGate(cost, block_size=GAMMA, probe_every=2), backlogs, took) == [
        max(min(2 << k, MAX_PROBE_BACKOFF * 2), longer) + 1 for k in range(6)]
    slowed = SimpleNamespace(draft_seconds=cost.draft_seconds, verify_seconds=cost.verify_seconds,
                             draft_factor=SLOW_DRAFTER)
    assert probe_gaps(DraftingGate(slowed, block_size=GAMMA, probe_every=2), backlogs) == [3] * 6


def one_request_probe_steps(gate: DraftingGate, backlog: int, took: float, expected: float,
                            drafting: float = 0.0) -> list[int]:
    """The steps one request probed at over 300 steps, each probe's step measured to take `took` seconds
    (`drafting` of them drafting) and to have verified drafts Algorithm 1 expected `expected` of."""
    probes = []
    for step in range(300):
        plan = gate.plan(np.array([backlog]))
        if len(plan.rows):
            probes.append(step)
            gate.record(plan, confident(1), (expected, 0), drafting_seconds=drafting, step_seconds=took)
        else:
            gate.record(plan, None)
    return probes


def one_request_probe_gaps(gate: DraftingGate, backlog: int, took: float, expected: float,
                           drafting: float = 0.0) -> list[int]:
    """Steps between the first 5 probes of one request once its pool holds THIN_POOL_ROWS rows."""
    probes = one_request_probe_steps(gate, backlog, took, expected, drafting)[THIN_POOL_ROWS - 1:]
    return [b - a for a, b in pairwise(probes)][:4]


def test_one_request_probes_at_once_while_the_pool_is_thin():
    """A decline resting on fewer than THIN_POOL_ROWS survival rows (one unlucky block makes it: measured at one
    request on the demo engine, a pool of one row kept drafting declined for up to 50 steps) is probed again at
    the next step, which for one request is a drafting step with its drafts verified; then probes are spaced."""
    probes = one_request_probe_steps(DraftingGate(DEAR, block_size=GAMMA, probe_every=2), 5, 3 * DEAR.verify_seconds(
        1, 1), 2.0)
    assert probes[:THIN_POOL_ROWS] == list(range(THIN_POOL_ROWS))
    assert probes[THIN_POOL_ROWS] - probes[THIN_POOL_ROWS - 1] == FULL_PROBE_EVERY + 1


def test_one_requests_probe_is_spaced_by_what_it_cost_beyond_plain_decoding(monkeypatch):
    """One request probes itself: a drafting step, its drafts verified. The next comes once the plain steps since
    have cost its net cost (its time less what plain decoding of the tokens it was expected to yield takes) over
    PROBE_SHARE, no sooner than FULL_PROBE_EVERY steps, no later than the longest backoff; without doubling."""
    monkeypatch.setattr(probe_spacing, "PROBE_SHARE", SHARE)
    plain = DEAR.verify_seconds(1, 1)
    # a probe that cost what its tokens would have (3 tokens: the anchor's, 2 drafts expected): probes come often
    gaps = one_request_probe_gaps(DraftingGate(DEAR, block_size=GAMMA, probe_every=2), 5, 3 * plain, 2.0)
    assert gaps == [FULL_PROBE_EVERY + 1] * 4  # (+ the probe step; backing off as probes of a few rows: 3, 5, 9, 17)
    # 0.52 plain steps dearer: ceil(0.52 / SHARE) = 11 plain steps between probes
    gaps = one_request_probe_gaps(DraftingGate(DEAR, block_size=GAMMA, probe_every=2), 5, 3.52 * plain, 2.0)
    assert gaps == [12] * 4
    # far dearer (a slowed drafter): at most the longest backoff apart
    gaps = one_request_probe_gaps(DraftingGate(DEAR, block_size=GAMMA, probe_every=2), 5, 50 * plain, 2.0)
    assert gaps == [MAX_FULL_PROBE_BACKOFF * 2 + 1] * 4
    # a backlog's catch-up is the backlog's cost, not drafting's: scaled out as in what the cost model learns
    gate = DraftingGate(DEAR, block_size=GAMMA, probe_every=2)
    plan = gate.plan(np.array([40]))
    assert plan.price > 1.5 * plan.normal  # 32 context rows past a normal step's
    drafting = 10 * plain  # of which all but normal / price is the catch-up's
    took = 3 * plain + drafting * (1 - plan.normal / plan.price)
    assert one_request_probe_gaps(DraftingGate(DEAR, block_size=GAMMA, probe_every=2), 40, took, 2.0,
                                  drafting) == [FULL_PROBE_EVERY + 1] * 4


def test_a_probe_pools_the_survivals_of_its_own_rows_only():
    """The rows that did not draft carry confidence −inf (survival 0): the pool takes the probe's rows alone,
    from the engine's survivals or from the confidences, the same rows either way."""
    backlogs = np.array([30, 5, 40, 5, 9, 12, 7, 50])
    logits = confident(8, 1.0)
    logits[[0, 2, 5, 7]] = -torch.inf  # the engine's rows that did not draft
    pools = []
    for given in (True, False):
        gate = DraftingGate(DEAR, block_size=GAMMA, probe_rows=4)
        plan = gate.plan(backlogs)
        gate.record(plan, logits, survivals=survival(logits).numpy() if given else None)
        pools.append(gate.pool.rows())
    assert len(pools[0]) == 4 and (pools[0] > 0).all()
    assert np.array_equal(pools[0], pools[1])


def test_first_step_decides_from_the_table_and_the_prior():
    backlogs = np.full(16, 8)
    assert DraftingGate(CHEAP, block_size=GAMMA).plan(backlogs).all  # drafting pays even at the prior
    # verify(16, B) = 1 ms + 0.03 ms·B, draft(16) = 1.6 ms: Θ_draft/Θ_plain = 1.31 at α = 0.9, 0.64 at 0.5
    cost = SplitCost(draft_per_request=1e-4, per_token=3e-5)
    assert DraftingGate(cost, block_size=GAMMA, prior_acceptance=0.9).plan(backlogs).all
    assert DraftingGate(cost, block_size=GAMMA).plan(backlogs).probe  # the default, conservative prior
    for logit, then in ((5.0, "all"), (-5.0, "none")):  # then the probe's confidences decide
        gate = DraftingGate(cost, block_size=GAMMA)
        gate.record(gate.plan(backlogs), confident(16, logit))
        assert (gate.plan(backlogs).all if then == "all" else not len(gate.plan(backlogs).rows))


def test_drafts_accepted_far_below_what_the_confidences_promised_stop_the_drafting():
    # verify(16, B) = 1 ms + 0.03 ms·B, draft(16) = 1.6 ms: confident rows (σ(5) = 0.993 a slot) pay
    cost, backlogs = SplitCost(draft_per_request=1e-4, per_token=3e-5), np.full(16, 8)

    def gate_after(accepted_share: float, steps: int = 10) -> DraftingGate:
        gate = DraftingGate(cost, block_size=GAMMA)
        for _ in range(steps):
            plan = GatePlan(16, np.arange(16), 1.0, 1.0)
            gate.record(plan, confident(16, 5.0), (80.0, round(80 * accepted_share)))
        return gate

    assert gate_after(1.0).plan(backlogs).all and gate_after(1.0).acceptance_scale == 1.0
    assert gate_after(0.95).acceptance_scale == 1.0  # within the deadband: taken as promised
    assert gate_after(1.4).acceptance_scale == pytest.approx(1.388, abs=1e-3)  # more accepted than promised
    assert gate_after(3.0).acceptance_scale == MAX_ACCEPTANCE_SCALE
    low = gate_after(0.2)
    assert low.acceptance_scale < 0.3 and not len(low.plan(backlogs).rows)  # plain decoding
    one = DraftingGate(cost, block_size=GAMMA)  # one unlucky step is shrunk toward what was promised
    one.record(GatePlan(16, np.arange(16), 1.0, 1.0), confident(16), (1.0, 0))
    assert one.acceptance_scale == 1.0  # 16 / 17: within the deadband
    one.record(GatePlan(16, np.arange(16), 1.0, 1.0), confident(16), (4.0, 0))
    assert one.acceptance_scale == pytest.approx(16 / (16 + 4 + 0.9))


def test_requests_that_join_are_not_judged_by_what_the_leavers_accepted():
    """`admitted`: the realised-acceptance sums keep the staying rows' share only."""
    def unlucky(rows: int) -> DraftingGate:
        gate = DraftingGate(SplitCost(draft_per_request=1e-4, per_token=3e-5), block_size=GAMMA)
        for _ in range(10):
            gate.record(GatePlan(rows, np.arange(rows), 1.0, 1.0), confident(rows, 5.0), (80.0, 16))
        return gate

    gate = unlucky(1)
    before = (gate.expected_drafts, gate.accepted_drafts, gate.acceptance_scale)
    assert before[2] < 0.5
    gate.admitted(1, 1)  # the one request left, a new one came: nothing of its luck stays
    assert gate.acceptance_scale == 1.0 and gate.expected_drafts == gate.accepted_drafts == 0.0
    gate = unlucky(4)
    gate.admitted(1, 4)  # three of four stayed: three quarters of the evidence
    assert (gate.expected_drafts, gate.accepted_drafts) == pytest.approx((0.75 * before[0], 0.75 * before[1]))
    assert before[2] < gate.acceptance_scale < 1.0  # still below promise, less surely
    gate.admitted(0, 4)
    assert gate.expected_drafts == pytest.approx(0.75 * before[0])


def test_more_accepted_than_promised_keeps_drafting_going_but_never_starts_it():
    # σ(1) = 0.73 a slot, 1.4x of it accepted: at 16 rows (draft 1.6 ms, verify 1 ms + 0.03 ms·B) drafting
    # pays only with the survivals scaled up (Θ_draft/Θ_plain 0.87 as promised, 1.09 as accepted)
    cost, backlogs = SplitCost(draft_per_request=1e-4, per_token=3e-5), np.full(16, 8)

    def under_confident(gate: DraftingGate) -> DraftingGate:
        for _ in range(10):
            gate.record(GatePlan(16, np.arange(16), 1.0, 1.0), confident(16, 1.0), (80.0, 112))
        return gate

    running = DraftingGate(cost, block_size=GAMMA, prior_acceptance=0.9)
    assert running.plan(backlogs).all  # drafting from the first step
    under_confident(running)
    assert all(running.plan(backlogs).all for _ in range(20))  # the realised acceptance keeps it going
    declined = DraftingGate(cost, block_size=GAMMA)
    assert declined.plan(backlogs).probe
    under_confident(declined)
    assert not declined.plan(backlogs).all  # scaled up from a declined state it would start: it does not
    promised = under_confident(DraftingGate(cost, block_size=GAMMA, prior_acceptance=0.9))
    promised.accepted_drafts = promised.expected_drafts
    promised.plan(backlogs)
    assert not promised.plan(backlogs).all  # as promised, drafting does not pay


def test_the_gate_prices_a_pool_of_alike_rows_the_same_whatever_its_size():
    # fewer rows than pool rows: the path goes by whole verified tokens (it used to stall between them)
    cost = SplitCost(draft_per_request=1e-4, per_token=3e-5)
    gate, seen = DraftingGate(cost, block_size=GAMMA), []
    for _ in range(4):
        gate.record(GatePlan(16, np.arange(16), 1.0, 1.0), confident(16, 5.0))
        seen.append([gate.throughputs(requests, cost.draft_seconds(requests))[0] for requests in (4, 16)])
    assert np.allclose(seen, seen[0], rtol=1e-9) and len(gate.pool) == 64


def test_a_declined_step_is_not_priced_again_until_something_it_rests_on_moved():
    calls = []

    class Counting(SplitCost):
        def draft_seconds(self, requests: int) -> float:
            calls.append(requests)
            return super().draft_seconds(requests)

    # drafting never pays: a clear decline, reused for CLEAR_DECLINE_STEPS (a narrow one: test_gate_reuse.py)
    gate = DraftingGate(Counting(draft_per_request=1.0, per_token=1e-4), block_size=GAMMA, probe_every=1000)
    backlogs = np.full(8, 8)
    gate.record(gate.plan(backlogs), confident(8))  # the first step probes (and prices)
    calls.clear()
    for step in range(1, 2 + CLEAR_DECLINE_STEPS):  # backlogs grow while nobody drafts: drafting only gets dearer
        plan = gate.plan(backlogs + step)
        assert not len(plan.rows)
        gate.record(plan, None)
    assert len(calls) == 1  # priced once (the probe moved the pool), then reused ...
    gate.plan(backlogs + 10)
    assert len(calls) == 2  # ... then priced again
    gate.plan(backlogs[:5] + 10)
    assert len(calls) == 3  # other rows: priced again at once
    gate.plan(backlogs[:5])
    assert len(calls) == 4  # smaller backlogs (drafting cheaper than when declined): priced again


@pytest.mark.parametrize("padded", [False, True], ids=["packed", "padded"])
def test_the_gate_predicts_what_algorithm_1_gets_over_rows_like_its_pool(padded):
    cost = SplitCost(draft_per_request=1e-4, per_token=1e-4)  # Algorithm 1 stops half-way, packed or padded
    gate = DraftingGate(cost, block_size=GAMMA, padded=padded)
    logits = torch.linspace(4.0, -1.0, 12 * GAMMA).reshape(12, GAMMA)
    gate.record(GatePlan(12, np.arange(12), 1.0, 1.0), logits)
    draft = cost.draft_seconds(12)
    decision = prefix_schedule(survival(logits), lambda requests, tokens: draft + cost.verify_seconds(requests, tokens),
                               padded=padded)
    assert 0 < sum(decision.lengths) < 12 * GAMMA / 2
    assert gate.throughputs(12, draft)[0] == pytest.approx(decision.expected_throughput)


def test_catch_up_is_priced_by_its_share_and_spread_over_the_steps_it_buys():
    cost = SplitCost(draft_per_request=1e-4, per_token=2e-5)  # drafting pays by more than SWITCH_MARGIN
    gate = DraftingGate(cost, block_size=GAMMA)
    gate.record(gate.plan(np.full(16, 8)), confident(16, 1.5))
    assert gate.plan(np.full(16, 8)).all
    normal = cost.draft_seconds(16)
    one = GatePlan(16, np.arange(16), gate._price(np.array([8] * 15 + [408])), normal)
    assert one.price == pytest.approx(normal * (1 + CONTEXT_ROW_COST * 400 / 16))  # its own 400 rows, not 16 × 400
    assert not gate.plan(np.full(16, 2000)).all  # a backlog that the drafting gain cannot repay
    backlogs = np.array([40] * 15 + [9])
    plan = gate.plan(backlogs)  # a short one that it can: the plan's price is its catch-up's
    assert plan.all and plan.price == pytest.approx(gate._price(backlogs)) and plan.price > normal


def test_split_calls_keeps_one_call_unless_a_backlog_would_pad_every_row():
    assert [c.tolist() for c in split_calls(np.full(5, 3))] == [[0, 1, 2, 3, 4]]
    assert [c.tolist() for c in split_calls(np.array([2, 5, 8, 3]))] == [[0, 1, 2, 3]]  # padding to 8 is cheap
    calls = split_calls(np.array([2] * 10 + [500] + [3] * 10))
    assert [sorted(c.tolist()) for c in calls] == [[*range(10), *range(11, 21)], [10]]


def test_the_cost_model_learns_drafting_as_a_normal_step_of_every_row():
    gate = DraftingGate(DEAR, block_size=GAMMA)
    plan = gate.plan(np.array([30, 5, 40, 5, 9, 12, 7, 50]))
    seconds = {"draft": 0.3, "heads": 0.1, "verify": 0.5, "commit": 0.01}
    record = StepRecord(step=0, requests=8, admitted_new=0, lengths=[0] * 8, verified_tokens=8, padded_tokens=8,
                        acceptance_lengths=[1] * 8, expected_accepts=None, predicted_seconds=None,
                        seconds=seconds, drafted=False)
    seen = gate.observed(record, plan)
    scale = DEAR.draft_seconds(8) / plan.price  # 4 rows -> 8, their catch-up scaled out
    assert seen.drafted and seen.seconds["draft"] == pytest.approx(0.3 * scale)
    assert seen.seconds["heads"] == pytest.approx(0.1 * scale) and seen.seconds["verify"] == 0.5
    full = DraftingGate(CHEAP, block_size=GAMMA)
    assert full.observed(record, full.plan(np.full(8, 3))) is record  # a normal step: as it was
    assert gate.observed(record, GatePlan(8, np.arange(0), 0.0, 8.0)) is record  # nobody drafted
