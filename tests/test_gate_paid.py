"""The drafting gate after a step whose drafts paid: it drafts on whatever the confidences promise,
for one step at a time (what a probe of every row found at one request, where the head under-promises)."""

from __future__ import annotations

import numpy as np
import pytest
from test_drafting_gate import GAMMA, SplitCost, confident, engine_for, greedy, prompts, run

from dspark.runtime.drafting_gate import DraftingGate, GatePlan

pytestmark = pytest.mark.usefixtures("one_thread")

# one request: draft 0.1 ms, verify(1, B) = 1 ms + 0.03 ms·B; plain decoding 971 tok/s. Rows whose head says
# σ(-5) = 0.007 a slot promise nothing, so the model declines; 8 tokens in 1.34 ms (5970 tok/s) pay.
COST = SplitCost(draft_per_request=1e-4, per_token=3e-5)
DOUBTFUL = -5.0


def declined_gate() -> DraftingGate:
    gate = DraftingGate(COST, block_size=GAMMA, probe_every=4)
    gate.record(GatePlan(1, np.arange(1), 1e-4, 1e-4), confident(1, DOUBTFUL), (0.05, 0), verified_tokens=8)
    assert not len(gate.plan(np.zeros(1, np.int64)).rows)  # the doubtful row: plain decoding
    return gate


def next_plans(gate: DraftingGate, accepted: int, tokens: int | None, steps: int = 3) -> list[int]:
    """Rows drafting at the probe and at the `steps` steps after it, each drafting step accepting `accepted`."""
    backlogs = np.zeros(1, np.int64)
    while not len(plan := gate.plan(backlogs).rows):
        gate.record(GatePlan(1, plan, 0.0, 1e-4), None)
    rows = [len(plan)]
    for _ in range(steps):
        gate.record(GatePlan(1, np.arange(1), 1e-4, 1e-4), confident(1, DOUBTFUL), (0.05, accepted),
                    verified_tokens=tokens)
        plan = gate.plan(backlogs).rows
        rows.append(len(plan))
        if not len(plan):
            gate.record(GatePlan(1, plan, 0.0, 1e-4), None)
    return rows


def test_a_probe_whose_drafts_paid_drafts_on_while_they_pay():
    assert next_plans(declined_gate(), accepted=GAMMA, tokens=GAMMA + 1) == [1, 1, 1, 1]
    assert next_plans(declined_gate(), accepted=0, tokens=GAMMA + 1) == [1, 0, 0, 0]  # it did not pay: declined
    assert next_plans(declined_gate(), accepted=GAMMA, tokens=None) == [1, 0, 0, 0]  # not told what it verified


def test_paid_prices_the_step_as_a_normal_drafting_step():
    gate = DraftingGate(COST, block_size=GAMMA)
    plan = GatePlan(1, np.arange(1), price=1.0, normal=1e-4)  # a catch-up of a whole second: paid once
    assert gate.paid(plan, 1, 8)  # 2 tokens in 1.34 ms against 1 in 1.03 ms
    assert not gate.paid(plan, 0, 8)  # 1 token in 1.34 ms
    assert not gate.paid(GatePlan(1, np.arange(1), 1e-3, 1e-3), 1, 8)  # a slow drafter: 2 in 2.24 ms


def test_the_engine_tells_the_gate_what_each_step_verified(monkeypatch):
    seen = []
    record = DraftingGate.record

    def spy(self, plan, confidence_logits, verified=None, survivals=None, verified_tokens=None):
        seen.append(verified_tokens)
        record(self, plan, confidence_logits, verified, survivals, verified_tokens)

    monkeypatch.setattr(DraftingGate, "record", spy)
    engine, _ = engine_for(SplitCost(draft_per_request=1e-6, per_token=1e-5))
    asked = run(engine, {0: list(prompts())[:2]}, 16)
    assert seen == [s.verified_tokens for s in engine.stats.steps]
    assert max(seen) > 2  # drafts were verified, and the gate heard how many
    results = {rid: engine.take_result(rid) for rid in asked}
    assert all(r.tokens == greedy(asked[rid], 16) for rid, r in results.items())
