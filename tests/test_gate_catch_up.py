"""What the cost model learns from a step that caught up a backlog: a catch-up dearer than its price is
no measure of the drafter (left out), a cheaper one is good news (learned as a normal step)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_drafting_gate import GAMMA, SplitCost
from test_drafting_gate_engine import engine_for, greedy, prompts, run

from dspark.runtime.drafting_gate import DraftingGate
from dspark.runtime.live_cost import LiveSplitStepCost
from dspark.runtime.stats import StepRecord

pytestmark = pytest.mark.usefixtures("one_thread")

COST = SplitCost(draft_per_request=1e-4, per_token=3e-5)  # one request: draft 0.1 ms, verify 1 ms + 0.03 ms·B


def step(seconds: dict[str, float]) -> StepRecord:
    return StepRecord(step=0, requests=1, admitted_new=0, lengths=[7], verified_tokens=8, padded_tokens=8,
                      acceptance_lengths=[8], expected_accepts=None, predicted_seconds=None, seconds=seconds)


def test_a_catch_up_dearer_than_its_price_teaches_no_drafting_speed():
    gate = DraftingGate(COST, block_size=GAMMA)
    plan = gate.plan(np.array([40]))  # a new request: its 40 prompt rows caught up
    assert plan.all and plan.excess == 40 - (GAMMA + 1) and plan.price > plan.normal
    phases = {"heads": 0.0, "schedule": 1e-5, "verify": 1e-3, "commit": 1e-5}
    dear = gate.observed(step({"draft": 10 * plan.price, **phases}), plan)  # dearer than CONTEXT_ROW_COST says
    assert not dear.drafted and set(dear.seconds) == {"verify", "commit"}  # learned as a plain step
    cheap = gate.observed(step({"draft": 0.5 * plan.price, **phases}), plan)  # the drafter is at least this fast
    assert cheap.drafted and cheap.seconds["draft"] == pytest.approx(0.5 * plan.normal)
    assert cheap.seconds["schedule"] == 1e-5 and cheap.seconds["verify"] == 1e-3


def draft_factor(monkeypatch, catch_up_delay: float) -> float:
    """The live draft factor after one-slot requests of 3 new tokens each (most drafting steps catch a prompt
    up), every drafter call that feeds more context rows than a normal step's taking `catch_up_delay` more
    (spent busy: the test is about what the model learns, not about how a VM wakes from sleep)."""
    live = LiveSplitStepCost(COST)
    engine, _ = engine_for(live, slots=1)
    draft = engine.drafter.draft

    def slow_catch_up(anchors, starts, pending, rows=None, greedy=False):
        if max(sum(len(c) for c in chunks) for chunks in pending) > GAMMA + 1:
            busy_until = time.perf_counter() + catch_up_delay  # busy, not asleep: a sleeping vCPU woke
            while time.perf_counter() < busy_until:  # 3-5x slower for the next steps on CI's VM
                pass
        return draft(anchors, starts, pending, rows, greedy=greedy)

    monkeypatch.setattr(engine.drafter, "draft", slow_catch_up)
    asked = run(engine, {0: list(prompts()) * 2}, 3)
    assert all(engine.take_result(rid).tokens == greedy(prompt, 3) for rid, prompt in asked.items())
    return live.draft_factor


def test_slow_catch_ups_leave_the_live_draft_factor_alone_in_the_engine(monkeypatch):
    plain, slow = draft_factor(monkeypatch, 0.0), draft_factor(monkeypatch, 0.05)
    assert slow < 3 * plain, (plain, slow)  # learned, 50 ms catch-ups would multiply it ~10-20x
