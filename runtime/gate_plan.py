"""The drafting gate's vocabulary, shared by the gate (drafting_gate.py), the engine (batch_loop.py) and the live
cost model (live_cost.py): one step's drafting plan, the split cost model it is priced with, what a catch-up of
skipped context costs, and a step record as a cost model should learn it when its drafting says nothing of the
drafter's speed."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import numpy as np

from .drafter_runner import CONTEXT_ROW_COST
from .stats import StepRecord

DRAFTING = ("draft", "heads")  # a step's phases that draft (StepRecord.seconds)
DRAFTING_STEP = (*DRAFTING, "schedule")  # what a drafting step adds to a plain one (the live model's `drafting`)


def without_drafting(record: StepRecord) -> StepRecord:
    """`record` as a step that did not draft: its drafting phases left out, for a cost model that should learn
    nothing of the drafter from it (a catch-up dearer than its price, a call that bound a new layout)."""
    return replace(record, seconds={k: v for k, v in record.seconds.items() if k not in DRAFTING_STEP}, drafted=False)


def catch_up_price(normal: float, excess: int, rows: int, steps: int = 1) -> float:
    """Seconds of drafting `rows` rows whose normal step costs `normal`, with `excess` context rows beyond a
    normal step's to catch up, that share spread over `steps` steps (drafting_gate's docstring: catch-up)."""
    return normal * (1.0 + CONTEXT_ROW_COST * excess / (rows * steps))


@runtime_checkable
class SplitStepCost(Protocol):
    """A step cost model that prices the drafter and the target separately."""

    def draft_seconds(self, requests: int) -> float: ...

    def verify_seconds(self, requests: int, tokens: int) -> float: ...


@dataclass(frozen=True)
class GatePlan:
    """One step's drafting: which active rows draft, and what the gate expects it to cost."""

    requests: int  # R active rows
    rows: np.ndarray  # [k] active rows that draft, ascending (empty: none; 0..R-1: all)
    price: float  # predicted seconds of drafting them, their whole backlogs included (0.0 if none)
    normal: float  # predicted seconds of a normal drafting step of all R rows
    excess: int = 0  # context rows they catch up beyond a normal step's (0: no catch-up)
    declined: bool = False  # drafting does not pay: at most a probe drafts (at most half the rows, rounded up)

    @property
    def all(self) -> bool:
        return len(self.rows) == self.requests

    @property
    def probe(self) -> bool:
        return 0 < len(self.rows) < self.requests
