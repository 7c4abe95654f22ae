"""A decline that no confidence could end probes no more: where drafting every row would not pay by the switching
margin even with every draft accepted, the gate neither probes nor prices every step, re-prices as any decline
does, and drafts again once the costs allow it; a drafter the live model learned slow is priced at the table's
speed there. In the engine, such a decline never calls the drafter and greedy output stays the target's."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_drafting_gate import CHEAP, DEAR, GAMMA, SplitCost
from test_drafting_gate_engine import engine_for, greedy, prompts

from dspark.runtime.drafting_gate import CEILING_MARGIN, CLEAR_DECLINE_STEPS, DECLINE_STEPS, DraftingGate

pytestmark = pytest.mark.usefixtures("one_thread")

# 8 rows: the prior (α = 0.5) declines, every draft accepted would pay 2.1x plain decoding: the gate probes
MARGINAL = SplitCost(draft_per_request=3e-4, per_token=1e-5)
BACKLOGS = np.full(8, 8)


class Counting(SplitCost):
    calls: list[int]

    def draft_seconds(self, requests: int) -> float:
        self.calls.append(requests)
        return super().draft_seconds(requests)


def ceiling_ratio(cost: SplitCost, requests: int) -> float:
    """Θ with every draft accepted ÷ Θ of plain decoding, over the γ + 1 depths (what the gate weighs)."""
    tokens = requests * (1 + np.arange(GAMMA + 1))
    ceiling = max(tokens / (cost.draft_seconds(requests) + cost.verify_seconds(requests, tokens)))
    return ceiling / (requests / cost.verify_seconds(requests, requests))


def test_the_costs_here_are_on_either_side_of_the_ceiling():
    assert ceiling_ratio(DEAR, 8) < CEILING_MARGIN < ceiling_ratio(MARGINAL, 8)


def test_no_probe_where_no_confidence_could_make_drafting_pay():
    cost = Counting(DEAR.draft_per_request, DEAR.per_token)
    cost.calls = []
    gate = DraftingGate(cost, block_size=GAMMA, probe_every=2)
    for _ in range(200):
        plan = gate.standing_decline() or gate.plan(BACKLOGS)
        assert plan.declined and not len(plan.rows)  # the first step too: no probe, ever
        gate.record(plan, None)
    assert not gate.pool  # nothing drafted: the decline stands on the costs alone ...
    assert len(cost.calls) <= 200 // CLEAR_DECLINE_STEPS + 1  # ... priced once a reuse, not every step
    # control: where every draft accepted would pay, the same gate probes from the first step
    control = DraftingGate(MARGINAL, block_size=GAMMA, probe_every=2)
    first = control.plan(BACKLOGS)
    assert first.declined and first.probe


def test_the_decline_is_priced_again_and_drafting_resumes_once_the_costs_allow_it():
    gate = DraftingGate(DEAR, block_size=GAMMA)
    for _ in range(3):
        gate.record(gate.plan(BACKLOGS), None)
    gate.cost = CHEAP  # a cost model that moved: drafting pays even at the prior's acceptance
    plans = [gate.standing_decline() or gate.plan(BACKLOGS) for _ in range(CLEAR_DECLINE_STEPS + DECLINE_STEPS)]
    assert plans[-1].all  # re-priced when the reuse ran out: every row drafts, with no probe before


def test_a_drafter_learned_slow_is_priced_at_the_tables_speed_for_the_ceiling():
    slow = SplitCost(draft_per_request=10 * MARGINAL.draft_per_request, per_token=MARGINAL.per_token)
    assert ceiling_ratio(slow, 8) < CEILING_MARGIN  # at the learned speed no confidence would pay ...
    live = SimpleNamespace(draft_seconds=slow.draft_seconds, verify_seconds=slow.verify_seconds, prior=MARGINAL)
    assert DraftingGate(live, block_size=GAMMA).plan(BACKLOGS).probe  # ... at the table's it might: a probe
    alone = SimpleNamespace(draft_seconds=slow.draft_seconds, verify_seconds=slow.verify_seconds)
    assert not len(DraftingGate(alone, block_size=GAMMA).plan(BACKLOGS).rows)  # control: no table, no probe


def test_the_engine_never_drafts_where_no_confidence_could_pay_and_greedy_stays_the_targets():
    engine, recorder = engine_for(DEAR)
    chosen = prompts()[:6]
    ids = [engine.submit(list(p), max_new_tokens=12) for p in chosen]
    results = engine.run_until_done()
    assert not recorder.calls  # no probe, no drafting step: the drafter never ran
    for request_id, prompt in zip(ids, chosen, strict=True):
        assert results[request_id].tokens == greedy(prompt, 12)
    # control: the same engine where drafting may pay probes from its first step
    engine, recorder = engine_for(MARGINAL)
    engine.submit(list(chosen[0]), max_new_tokens=4)
    engine.run_until_done()
    assert recorder.calls

