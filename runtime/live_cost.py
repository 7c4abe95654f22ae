"""A step cost model kept current from the steps the engine times: the prior, scaled by live load.

The prior (an engine's measured `CostTable`, or a profiled `StepCostModel`) was measured once, on
an idle machine. A competing process, a hotter chip or a slower host changes what a step costs,
and Algorithm 1 and the drafting gate should decide on today's costs. After every step the
engine calls `observe(record)` and this model prices (prefill never counts)

    seconds(R, B) = draft(R)·f_draft(R) + verify(R, B)·f_verify(R, B) + overhead(R)   (split prior, CostTable)
    seconds(R, B) = prior(R, B)·f_step(R, B)                                          (whole-step prior)

with drafting = draft + heads + schedule phases of drafting steps, verification = the verify
phase, overhead = commit (+ schedule of plain steps), seconds added once per step whatever B is.
Folding that fixed Python time into a ratio would make it grow with B and shrink the schedule.

Why medians over cells. A cell is (R, B) in quarter-octave buckets; its value is the median of
what it saw during the last `horizon` steps, given `min_samples` of them. Along B a row is
interpolated between its cells (flat past the ends), so the cost stays continuous in B where
one cell is fresh and its neighbour is not; a row without such cells takes the load factor, the
median over every cell in the horizon (and at least the `min_samples` latest values, however
old, so drafting seen only at the gate's probes still follows them).
- Robust: a garbage-collector pause or a preempted step is one value among several; a median
  ignores it, where a mean or a least-squares refit would chase it.
- Bounded reaction: nothing older than `horizon` steps counts, so a cell in use follows a change
  of load within horizon/2 + 1 steps (17 by default; the issue asks for 32) and comes back as fast.
- Bounded memory: `window` values per cell, at most `max_cells` cells (least recently seen dropped).

A uniform slowdown multiplies every price by one factor and leaves Algorithm 1's choice alone
(Θ = τ / t(R, B) keeps its argmax); what moves the schedule is a change of relative costs: the
drafter against the target (the drafting gate), per token against per step (the prefix length).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from statistics import median
from typing import Any

import numpy as np

from .cost_model import StepCost
from .drafting_gate import SplitStepCost
from .stats import StepRecord

Tokens = int | np.ndarray
MIN_SECONDS = 1e-9


def bucket(count: int | np.ndarray) -> int | np.ndarray:
    """Quarter-octave bucket of a count: exact up to 8, then ~19% wide."""
    if isinstance(count, np.ndarray):
        return np.rint(4 * np.log2(np.maximum(count, 1))).astype(np.int64)
    return round(4 * math.log2(max(count, 1)))


def at_least(value: float | np.ndarray, floor: float = MIN_SECONDS) -> float | np.ndarray:
    return np.maximum(value, floor) if isinstance(value, np.ndarray) else max(float(value), floor)


class CellMedians:
    """Recent values (ratios, or seconds) per (R, B) cell and over all cells: module docstring."""

    def __init__(self, *, window: int, horizon: int, min_samples: int, max_cells: int, empty: float) -> None:
        self.window, self.horizon, self.min_samples, self.max_cells = window, horizon, min_samples, max_cells
        self.empty = empty  # the level before anything was seen
        self.cells: OrderedDict[tuple[int, int], deque[tuple[int, float]]] = OrderedDict()  # -> (step, value)
        self.recent: deque[tuple[int, float]] = deque(maxlen=max(horizon, min_samples))
        self._rows: dict[int, tuple[list[int], list[float]]] = {}  # row -> its fresh cells; valid at _now
        self._now = -1

    def add(self, now: int, requests: int, tokens: int, value: float) -> None:
        cell = (bucket(requests), bucket(tokens))
        values = self.cells.pop(cell, None) or deque(maxlen=self.window)
        values.append((now, value))
        self.cells[cell] = values  # most recently seen last
        if len(self.cells) > self.max_cells:
            self.cells.popitem(last=False)
        self.recent.append((now, value))
        self._now = -1

    def _fresh(self, now: int, entries: deque[tuple[int, float]]) -> list[float]:
        return [v for t, v in entries if now - t < self.horizon]

    def level(self, now: int) -> float:
        """Median over every cell within the horizon (at least the `min_samples` latest values)."""
        fresh = self._fresh(now, self.recent)
        if len(fresh) < self.min_samples:
            fresh = [v for _, v in list(self.recent)[-self.min_samples:]]
        return median(fresh) if fresh else self.empty

    def _row(self, now: int, row: int) -> tuple[list[int], list[float]]:
        if now != self._now:
            self._rows, self._now = {}, now
        if row not in self._rows:
            points = sorted((b, median(f)) for (r, b), values in self.cells.items()
                            if r == row and len(f := self._fresh(now, values)) >= self.min_samples)
            self._rows[row] = ([b for b, _ in points], [m for _, m in points]) if points else ([], [self.level(now)])
        return self._rows[row]

    def at(self, now: int, requests: int, tokens: Tokens = 0) -> float | np.ndarray:
        """Value at (R, B): interpolated along B between the row's fresh cells; elementwise over arrays."""
        xs, ys = self._row(now, bucket(requests))
        if not xs:
            return np.full(np.shape(tokens), ys[0]) if isinstance(tokens, np.ndarray) else ys[0]
        value = np.interp(bucket(tokens), xs, ys)
        return value if isinstance(tokens, np.ndarray) else float(value)


class LiveStepCost:
    """`prior` corrected by the load measured on the engine's own steps. Has `draft_seconds` and
    `verify_seconds` (so the engine keeps its drafting gate) exactly when the prior has them."""

    def __new__(cls, prior: StepCost | None = None, **options: int) -> LiveStepCost:
        if cls is LiveStepCost and isinstance(prior, SplitStepCost):
            cls = LiveSplitStepCost
        return super().__new__(cls)

    def __init__(self, prior: StepCost, *, window: int = 16, horizon: int = 32, min_samples: int = 3,
                 max_cells: int = 256) -> None:
        if min(window, horizon, min_samples, max_cells) < 1:
            raise ValueError("window, horizon, min_samples and max_cells must be >= 1")
        self.prior: Any = prior.prior if isinstance(prior, LiveStepCost) else prior  # one live layer
        self.steps = 0  # decode steps observed

        def cells(empty: float) -> CellMedians:
            return CellMedians(window=window, horizon=horizon, min_samples=min_samples, max_cells=max_cells,
                               empty=empty)

        self.step_ratios, self.draft_ratios, self.verify_ratios = cells(1.0), cells(1.0), cells(1.0)
        self.overhead = cells(0.0)  # seconds per step outside the graphs' prior (split priors)

    def observe(self, record: StepRecord) -> None:
        """Learn from one timed decode step (the engine calls this after every step)."""
        if record.requests < 1:
            return
        self.steps += 1
        spent = record.total_seconds - record.seconds.get("prefill", 0.0)
        self._ratio(self.step_ratios, record, spent, self._step_prior(record))

    def _ratio(self, cells: CellMedians, record: StepRecord, seconds: float, prior: float, tokens: int = -1) -> None:
        if seconds > 0 and prior > MIN_SECONDS:
            cells.add(self.steps, record.requests, record.verified_tokens if tokens < 0 else tokens, seconds / prior)

    def _step_prior(self, record: StepRecord) -> float:
        return float(self.prior.seconds(record.requests, record.verified_tokens))

    def seconds(self, requests: int, tokens: Tokens) -> float | np.ndarray:
        """Predicted seconds of one decode step; elementwise over an array of token counts."""
        return at_least(self.prior.seconds(requests, tokens) * self.step_ratios.at(self.steps, requests, tokens))

    @property
    def load_factor(self) -> float:
        """Observed/prior step time over the last `horizon` steps (median; 1.0 = as measured)."""
        return self.step_ratios.level(self.steps)

    def to_dict(self) -> dict[str, Any]:
        live: dict[str, Any] = {"load_factor": self.load_factor, "observed_steps": self.steps,
                                "cells": len(self.step_ratios.cells)}
        if isinstance(self, LiveSplitStepCost):
            live.update(draft_factor=self.draft_ratios.level(self.steps),
                        verify_factor=self.verify_ratios.level(self.steps),
                        overhead_ms=1e3 * self.overhead.level(self.steps))
        return {"prior": self.prior.to_dict(), "live": live}


class LiveSplitStepCost(LiveStepCost):
    """Over a prior that prices drafting and verification apart: each part scaled by what was
    learned for it, plus the per-step overhead, so the drafting gate sees a slowed drafter or target."""

    def observe(self, record: StepRecord) -> None:
        super().observe(record)
        if record.requests < 1:
            return
        seconds, rows = record.seconds, record.requests
        self._ratio(self.verify_ratios, record, seconds.get("verify", 0.0),
                    float(self.prior.verify_seconds(rows, record.verified_tokens)))
        overhead = seconds.get("commit", 0.0) + (0.0 if record.drafted else seconds.get("schedule", 0.0))
        self.overhead.add(self.steps, rows, 0, overhead)
        if record.drafted:
            drafting = sum(seconds.get(phase, 0.0) for phase in ("draft", "heads", "schedule"))
            self._ratio(self.draft_ratios, record, drafting, float(self.prior.draft_seconds(rows)), tokens=0)

    def _step_prior(self, record: StepRecord) -> float:
        draft = self.prior.draft_seconds(record.requests) if record.drafted else 0.0
        return float(draft + self.prior.verify_seconds(record.requests, record.verified_tokens))

    def draft_seconds(self, requests: int) -> float:
        return float(self.prior.draft_seconds(requests)) * float(self.draft_ratios.at(self.steps, requests))

    def verify_seconds(self, requests: int, tokens: Tokens) -> float | np.ndarray:
        """The target's verification and the step's fixed overhead (plain decoding pays both)."""
        scaled = self.prior.verify_seconds(requests, tokens) * self.verify_ratios.at(self.steps, requests, tokens)
        return at_least(scaled + float(self.overhead.at(self.steps, requests)))

    def seconds(self, requests: int, tokens: Tokens) -> float | np.ndarray:
        return at_least(self.draft_seconds(requests) + self.verify_seconds(requests, tokens))
