"""A clear "drafting pays" (by PAYS_MARGIN or more) is reused like a decline: not priced again for up to
DECLINE_STEPS steps while the rows stay and their backlogs do not grow, and priced at once after a step that
drafted and bought nothing; a narrow one is reused for NARROW_PAYS_STEPS steps. A clear decline stands longer."""

from __future__ import annotations

import numpy as np
import pytest
from test_drafting_gate import GAMMA, SplitCost, confident

from dspark.runtime.drafting_gate import (
    CLEAR_DECLINE,
    CLEAR_DECLINE_STEPS,
    DECLINE_STEPS,
    NARROW_PAYS_STEPS,
    PAYS_MARGIN,
    SWITCH_MARGIN,
    DraftingGate,
)


class Counting(SplitCost):
    calls: list[int]

    def draft_seconds(self, requests: int) -> float:
        self.calls.append(requests)
        return super().draft_seconds(requests)


def gate_with(per_token: float) -> tuple[DraftingGate, list[int]]:
    cost = Counting(draft_per_request=1e-4, per_token=per_token)
    cost.calls = []
    return DraftingGate(cost, block_size=GAMMA, prior_acceptance=0.9), cost.calls


LIKE_THE_PRIOR = float(np.log(9.0))  # σ = 0.9 a slot: the survivals of the prior row (α = 0.9)


def drafting_steps(gate: DraftingGate, backlogs: np.ndarray, steps: int, accepted: int = 10) -> None:
    """Steps that draft every row, each confident like the prior and accepting what it expected (10 drafts)."""
    for _ in range(steps):
        plan = gate.plan(backlogs)
        assert plan.all
        gate.record(plan, confident(len(backlogs), LIKE_THE_PRIOR), (10.0, accepted))


def test_a_clear_pays_is_reused_until_a_step_buys_nothing():
    gate, calls = gate_with(per_token=1e-5)  # verification nearly free: drafting pays by far
    backlogs = np.full(4, 8)
    with_drafts, plain = gate.throughputs(4, gate.cost.draft_seconds(4))
    assert with_drafts >= PAYS_MARGIN * plain
    calls.clear()
    drafting_steps(gate, backlogs, 1 + DECLINE_STEPS)
    assert len(calls) == 1  # priced once, then reused for DECLINE_STEPS steps ...
    drafting_steps(gate, backlogs, 1)
    assert len(calls) == 2  # ... then priced again
    drafting_steps(gate, backlogs + 1, 1)
    assert len(calls) == 3  # larger backlogs (drafting dearer): priced again
    drafting_steps(gate, backlogs[:3], 1)
    assert len(calls) == 4  # other rows: priced again
    drafting_steps(gate, backlogs[:3], 1, accepted=0)  # a step that bought nothing ...
    drafting_steps(gate, backlogs[:3], 1)
    assert len(calls) == 5  # ... is priced again at once


def test_a_narrow_pays_is_reused_for_fewer_steps():
    gate, calls = gate_with(per_token=3.5e-4)  # drafting pays, by less than PAYS_MARGIN (enough to switch to it)
    backlogs = np.full(4, 8)
    with_drafts, plain = gate.throughputs(4, gate.cost.draft_seconds(4))
    assert SWITCH_MARGIN * plain < with_drafts < PAYS_MARGIN * plain
    plan = gate.plan(backlogs)  # before any row drafted, a "pays" by the switching margin drafts every row
    assert plan.all and not plan.probe
    gate.record(plan, confident(len(backlogs), LIKE_THE_PRIOR))
    calls.clear()
    drafting_steps(gate, backlogs, 8)
    assert NARROW_PAYS_STEPS == 1 and len(calls) == 4  # priced, then reused one step, four times
    drafting_steps(gate, backlogs, 1, accepted=0)  # a step that bought nothing ...
    calls.clear()
    drafting_steps(gate, backlogs, 1)
    assert len(calls) == 1  # ... is priced again at once


@pytest.mark.parametrize("margin", [SWITCH_MARGIN, 1.0], ids=["margin", "control-without-margin"])
def test_after_a_decline_drafting_every_row_again_needs_the_switching_margin(monkeypatch, margin):
    """A gain under SWITCH_MARGIN keeps a declined gate declined (the switch would pay for backlogs and wider
    verification the table does not price); the control, the same gate without the margin, switches."""
    import dspark.runtime.drafting_gate as gate_module

    monkeypatch.setattr(gate_module, "SWITCH_MARGIN", margin)
    gate, _ = gate_with(per_token=5e-4)  # drafting pays, by less than the margin
    backlogs = np.full(4, 8)
    first = gate.plan(backlogs)  # the first step: no pool, a prior gain under the margin probes (the control drafts)
    assert first.probe == (margin != 1.0)
    gate.record(first, confident(len(backlogs), LIKE_THE_PRIOR))
    with_drafts, plain = gate.throughputs(4, gate.cost.draft_seconds(4))
    assert plain < with_drafts < SWITCH_MARGIN * plain
    assert gate.plan(backlogs).all == (margin == 1.0)


@pytest.mark.usefixtures("probes_whatever_the_ceiling")
def test_a_standing_decline_is_reused_unpriced_until_a_probe_is_due_or_it_would_be_priced_again(monkeypatch):
    """`standing_decline` (the engine asks it while its active rows stay the same): the last plan again, with no
    pricing, while it drafted no row, the pool has not moved, it was reused fewer than DECLINE_STEPS times and no
    probe is due; otherwise None (the engine then calls `plan`)."""
    import dspark.runtime.probe_spacing as spacing_module

    monkeypatch.setattr(spacing_module, "PROBE_SHARE", 1e9)  # probes as often as probe_every allows
    cost = Counting(draft_per_request=1.0, per_token=1e-4)  # drafting never pays
    cost.calls = []
    gate, backlogs = DraftingGate(cost, block_size=GAMMA, probe_every=3), np.full(4, 8)
    assert gate.standing_decline() is None  # nothing planned yet
    probe = gate.plan(backlogs)
    assert probe.probe and gate.standing_decline() is None  # a probe is no decline to stand
    gate.record(probe, confident(len(backlogs)))
    declined = gate.plan(backlogs + 1)
    assert declined.declined and not len(declined.rows)
    gate.record(declined, None)
    calls = len(cost.calls)
    for _ in range(gate.probe_interval - 1):  # the steps until the next probe is due ...
        assert gate.standing_decline() is declined
        gate.record(declined, None)
    assert len(cost.calls) == calls  # ... unpriced
    assert gate.standing_decline() is None and gate.plan(backlogs + 9).probe  # then the probe, through `plan`

    gate = DraftingGate(cost, block_size=GAMMA, probe_every=1000)  # no probe due: the reuse bound bounds it
    gate.record(gate.plan(backlogs), confident(len(backlogs)))
    declined = gate.plan(backlogs + 1)
    stood = 0
    while gate.standing_decline() is declined:
        stood += 1
        gate.record(declined, None)
    assert stood == CLEAR_DECLINE_STEPS  # (drafting never pays: a clear decline)
    declined = gate.plan(backlogs + 2)  # priced again: a new decline, which stands ...
    assert gate.standing_decline() is declined
    gate.record(declined, None, (4.0, 1))  # ... until the realised acceptance moves
    assert gate.standing_decline() is None


@pytest.mark.usefixtures("probes_whatever_the_ceiling")
@pytest.mark.parametrize("draft_per_request, clear", [(3e-3, True), (8e-4, False)], ids=["clear", "narrow"])
def test_a_clear_decline_stands_longer(draft_per_request, clear):
    """Θ_draft < CLEAR_DECLINE·Θ_plain: reused unpriced for CLEAR_DECLINE_STEPS steps; a narrow decline for
    DECLINE_STEPS."""
    cost = Counting(draft_per_request=draft_per_request, per_token=3e-4)
    cost.calls = []
    gate = DraftingGate(cost, block_size=GAMMA, prior_acceptance=0.9, probe_every=1000)
    backlogs = np.full(4, 8)
    probe = gate.plan(backlogs)
    assert probe.probe
    gate.record(probe, confident(len(backlogs), LIKE_THE_PRIOR))
    with_drafts, plain = gate.throughputs(4, gate.cost.draft_seconds(4))
    assert with_drafts < plain and (with_drafts < CLEAR_DECLINE * plain) == clear
    declined = gate.plan(backlogs + 4)
    assert declined.declined and not len(declined.rows)
    priced, stood = len(cost.calls), 0
    while gate.standing_decline() is declined:
        stood += 1
        gate.record(declined, None)
    assert stood == (CLEAR_DECLINE_STEPS if clear else DECLINE_STEPS) and len(cost.calls) == priced
