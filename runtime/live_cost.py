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
  of load within horizon/2 + 1 steps, and prices within `PRICE_REFRESH` - 1 more (20 by default; the issue
  asks for 32), and come back as fast.
- Bounded memory: `window` values per cell, at most `max_cells` cells (least recently seen dropped).
- Plain steps (no drafting, B = R) of one R are learned one in `PLAIN_STRIDE`: a standing decline is a long run of
  such steps, and learning each was ~8 µs in place, ~2 % of a one-request plain step (~0.45 ms, demo engine on an
  AMD EPYC host). The clock counts every step, so a plain cell keeps 8 values in its horizon, and a slowdown of plain
  decoding is followed within horizon/2 + `PLAIN_STRIDE` steps; drafting steps are all learned.

A uniform slowdown multiplies every price by one factor and leaves Algorithm 1's choice alone
(Θ = τ / t(R, B) keeps its argmax); what moves the schedule is a change of relative costs: the
drafter against the target (the drafting gate), per token against per step (the prefix length).

Hot path (observe once a step, a few prices a step): the prior is tabled once per R over token counts
(priors are immutable), a cell keeps its values sorted and its median until it changes, and the
prices at R are tabled over token counts on their first price after every `PRICE_REFRESH` observations,
so a price is one lookup and a rebuild (~27 µs of a one-request step's ~2.8 ms, demo engine) comes every
fourth step. Interleaved A/B of that refresh (with two smaller cuts of a drafting step's host work), bench
sweep runner, 32-token requests, medians of 11-15 runs: the scheduler ÷ max(autoregressive, fixed γ) 0.894
→ 0.989 and 0.901 → 0.950 at one request, 0.879 → 0.900 at 2, 0.910 → 0.935 at 4.
"""

from __future__ import annotations

import math
import weakref
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from functools import partial
from statistics import median
from typing import Any

import numpy as np

from .cost_model import StepCost
from .gate_plan import SplitStepCost, without_drafting
from .stats import StepRecord

Tokens = int | np.ndarray
MIN_SECONDS = 1e-9
PRICE_REFRESH = 4  # observed steps between two rebuilds of the prices (a rebuild: ~27 µs, one request's step ~2.8 ms)
UNSEEN_LIMIT = 64  # steps observed, at most, before they are learned (memory stays bounded without a read)
PLAIN_STRIDE = 4  # plain steps (B = R, no drafting) of one R learned at most one in this many (module docstring)
LIMIT = 1 << 16  # token counts priced from tables; others (and non-counts) are priced directly, the same way


def bucket(count: int | np.ndarray) -> int | np.ndarray:
    """Quarter-octave bucket of a count: exact up to 8, then ~19% wide."""
    if isinstance(count, np.ndarray):
        return np.rint(4 * np.log2(np.maximum(count, 1))).astype(np.int64)
    return round(4 * math.log2(max(count, 1)))


def warm_record(record: StepRecord, *, drafter_bound: bool, target_bound: bool) -> StepRecord | None:
    """The step as a live model should learn it where its graph calls bound new layouts (`*_bound`): nothing
    (None) when the target's verification bound one, a step without drafting when only the drafter did. A call
    that binds a layout pays the binding and its first run, not the graph's speed: measured on the demo engine,
    one request at a time, +0.2-0.8 ms on a 0.8-1.1 ms backbone call, in 9 of a fresh engine's first 76 calls
    (16 short requests). A fresh engine's first drafting steps are mostly such calls; learned, they made the
    drafter look 1.6-2.4x slower than it was, and the drafting gate then declined where drafting paid."""
    if target_bound:
        return None
    return without_drafting(record) if drafter_bound and record.drafted else record


_PRIOR_TABLES: dict[tuple[int, bool], dict[int, tuple[Any, ...]]] = {}  # (id(prior), split) -> its tables by R


def prior_tables(prior: Any, split: bool) -> dict[int, tuple[Any, ...]]:
    """The tables of `prior` by R, shared by every live model over it while it lives (priors are immutable):
    tabling one R took ~0.1 ms, three of them ~0.3 ms of a fresh engine's first step (demo engine, 16 requests:
    a 2 ms step). A prior that cannot be referenced weakly gets tables of its own."""
    key = id(prior), split
    tables = _PRIOR_TABLES.get(key)
    if tables is None:
        tables = {}
        try:
            weakref.finalize(prior, _PRIOR_TABLES.pop, key, None)
        except TypeError:
            return tables
        _PRIOR_TABLES[key] = tables
    return tables


def floored(values: np.ndarray, bound: float) -> np.ndarray:
    """max(values, MIN_SECONDS) in place, skipped where `bound` (<= every value) shows it a no-op."""
    return values if bound > 2 * MIN_SECONDS else np.maximum(values, MIN_SECONDS, out=values)


class Cell(deque):
    """A cell's latest (step, value) pairs, oldest first (aged ones dropped when read), the values
    sorted, their median (None: fewer than `min_samples`) and the step at which to read it again."""

    __slots__ = ("median", "sorted", "until")


class CellMedians:
    """Recent values (ratios, or seconds) per (R, B) cell and over all cells: module docstring."""

    def __init__(self, *, window: int, horizon: int, min_samples: int, max_cells: int, empty: float) -> None:
        self.window, self.horizon, self.min_samples, self.max_cells = window, horizon, min_samples, max_cells
        self.empty = empty  # the level before anything was seen
        self.cells: OrderedDict[tuple[int, int], Cell] = OrderedDict()  # least recently seen first
        self.recent: deque[tuple[int, float]] = deque(maxlen=max(horizon, min_samples))
        self.rows: dict[int, dict[int, Cell]] = {}  # R bucket -> B bucket -> cell, by B
        self.version, self._key = 0, (-1, -1)  # values seen; (now, version) of _points
        self._points: dict[int, tuple[list[int], list[float]]] = {}  # row -> points(now, row), _key = (now, version)

    def add(self, now: int, cell: tuple[int, int], value: float) -> None:
        values = self.cells.get(cell)
        if values is None:
            values = self.cells[cell] = Cell(maxlen=self.window)
            values.sorted = []
            self.rows[cell[0]] = dict(sorted({**self.rows.get(cell[0], {}), cell[1]: values}.items()))
            if len(self.cells) > self.max_cells:
                (row, b), _ = self.cells.popitem(last=False)
                del self.rows[row][b]
        else:
            self.cells.move_to_end(cell)
            if len(values) == self.window:  # the oldest goes
                del values.sorted[bisect_left(values.sorted, values.popleft()[1])]
        values.append((now, value))
        insort(values.sorted, value)
        values.until = now
        self.recent.append((now, value))
        self.version += 1

    def level(self, now: int) -> float:
        """Median over every cell within the horizon (at least the `min_samples` latest values)."""
        fresh = [v for t, v in self.recent if now - t < self.horizon]
        if len(fresh) < self.min_samples:
            fresh = [v for _, v in list(self.recent)[-self.min_samples:]]
        return median(fresh) if fresh else self.empty

    def points(self, now: int, row: int) -> tuple[list[int], list[float]]:
        """A row's cells with `min_samples` fresh values: B buckets and medians, by B (none: [], [level])."""
        if self._key != (now, self.version):
            self._points, self._key = {}, (now, self.version)
        found = self._points.get(row)
        if found is None:
            xs, ys, horizon, least = [], [], self.horizon, self.min_samples
            for b, values in (self.rows.get(row) or {}).items():
                if now >= values.until:
                    while values and now - values[0][0] >= horizon:  # aged out
                        del values.sorted[bisect_left(values.sorted, values.popleft()[1])]
                    ordered, n = values.sorted, len(values)
                    values.until = values[0][0] + horizon if n >= least else math.inf  # inf: until a value comes
                    values.median = None if n < least else ordered[n // 2] if n % 2 else \
                        (ordered[n // 2 - 1] + ordered[n // 2]) / 2
                if values.median is not None:
                    xs.append(b)
                    ys.append(values.median)
            found = self._points[row] = (xs, ys) if xs else ([], [self.level(now)])
        return found


class LiveStepCost:
    """`prior` corrected by the load measured on the engine's own steps. Has `draft_seconds` and
    `verify_seconds` (so the engine keeps its drafting gate) exactly when the prior has them."""

    SPLIT = False  # a whole-step prior is priced as a split one with no drafting and no overhead

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
        cells = partial(CellMedians, window=window, horizon=horizon, min_samples=min_samples, max_cells=max_cells)
        self.step_ratios, self.draft_ratios, self.verify_ratios = cells(empty=1.0), cells(empty=1.0), cells(empty=1.0)
        self.overhead = cells(empty=0.0)  # seconds per step outside the graphs' prior (split priors)
        self._tables = prior_tables(self.prior, self.SPLIT)  # R -> _prior_table(R), for the prior _tables_of
        self._prices: dict[int, tuple[Any, ...]] = {}  # R -> this step's _build at R (`observe` drops them)
        self._tables_of = self.prior
        self._unseen: list[StepRecord] = []  # steps observed and not learned yet (`observe`)
        self._plain = (0, -PLAIN_STRIDE)  # (R, step) of the plain step last learned (`PLAIN_STRIDE`)

    def observe(self, record: StepRecord) -> None:
        """Learn from one timed decode step (the engine calls this after every step): queued, and learned in order
        before the next price or factor is read, so what is read is what learning each step at once gives. Right
        after a step's graph calls its host caches are cold, and learning one step cost ~23 µs there (demo engine,
        4 requests: 2 % of a plain step); a decline that stands reads no price for up to 16 steps."""
        if record.requests >= 1:
            self._unseen.append(record)
            if len(self._unseen) >= UNSEEN_LIMIT:
                self._catch_up()

    def _catch_up(self) -> None:
        unseen, self._unseen = self._unseen, []
        for record in unseen:
            if record.drafted or record.padded_tokens != record.requests:
                self._learn(record)
            elif record.requests != self._plain[0] or self.steps + 1 - self._plain[1] >= PLAIN_STRIDE:
                self._plain = record.requests, self.steps + 1
                self._learn(record)
            else:  # a plain step like the one learned a step or two ago: the clock moves, nothing is added
                self._tick()

    def _tick(self) -> None:
        """One more decode step on the model's clock; the prices are rebuilt every `PRICE_REFRESH`."""
        self.steps += 1
        if self.steps % PRICE_REFRESH == 0:
            self._prices.clear()

    def _learn(self, record: StepRecord) -> None:
        self._tick()
        # the tokens the step computed: a padded verification's R·W (what the table's B is measured as)
        rows, tokens, seconds, drafted = record.requests, record.padded_tokens, record.seconds, record.drafted
        table = self._prior_table(rows, min(max(tokens + 1, 1), LIMIT))
        known = 0 <= tokens < table[0].size
        prior = float(table[0][tokens] if known else self._prior(rows, tokens))
        row, draft = table[5], table[3] if drafted else 0.0
        cell = (row, int(table[1][tokens]) if known else bucket(tokens))
        self._ratio(self.step_ratios, cell, record.total_seconds - seconds.get("prefill", 0.0), float(draft + prior))
        if self.SPLIT:
            self._ratio(self.verify_ratios, cell, seconds.get("verify", 0.0), prior)
            self.overhead.add(self.steps, (row, 0),
                              seconds.get("commit", 0.0) + (0.0 if drafted else seconds.get("schedule", 0.0)))
            if drafted:
                drafting = seconds.get("draft", 0.0) + seconds.get("heads", 0.0) + seconds.get("schedule", 0.0)
                self._ratio(self.draft_ratios, (row, 0), drafting, draft)

    def _ratio(self, cells: CellMedians, cell: tuple[int, int], seconds: float, prior: float) -> None:
        if seconds > 0 and prior > MIN_SECONDS:
            cells.add(self.steps, cell, seconds / prior)

    def _prior(self, requests: int, tokens: Tokens) -> Any:
        """The prior's verification (a whole-step prior's step)."""
        return (self.prior.verify_seconds if self.SPLIT else self.prior.seconds)(requests, tokens)

    def _prior_table(self, requests: int, n: int) -> tuple[Any, ...]:
        """At R, once (priors are immutable): `_prior` over token counts 0 .. >= n - 1, their B buckets,
        arange(last bucket + 1), the prior's drafting, its least value over the counts, R's bucket."""
        if self._tables_of is not self.prior:  # a new prior: new tables
            self._tables, self._prices, self._tables_of = prior_tables(self.prior, self.SPLIT), {}, self.prior
        table = self._tables.get(requests)
        if table is None or table[0].size < n:
            tokens = np.arange(max(64, 1 << (n - 1).bit_length()))  # 2**k counts: see _price
            prior = np.broadcast_to(np.asarray(self._prior(requests, tokens), dtype=np.float64), tokens.shape)
            buckets, draft = bucket(tokens), float(self.prior.draft_seconds(requests)) if self.SPLIT else 0.0
            table = (prior, buckets, np.arange(buckets[-1] + 1.0), draft, float(prior.min()), bucket(requests))
            self._tables[requests] = table
        return table

    def _build(self, prior: np.ndarray, buckets: np.ndarray, span: np.ndarray, draft: float, low: float,
               row: int) -> tuple[Any, ...]:
        """(seconds, verification) at R's bucket `row` where the prior is `prior` (>= low) and B's buckets
        `buckets` (span = arange(max + 1)), and drafting: interpolated along B (module docstring)."""
        now = self.steps
        draft *= float(self.draft_ratios.points(now, row)[1][0])  # at B = 0: the row's first value
        overhead = float(self.overhead.points(now, row)[1][0])
        xs, ys = (self.verify_ratios if self.SPLIT else self.step_ratios).points(now, row)
        verify = prior * (np.interp(span, xs, ys)[buckets] if len(xs) > 1 else ys[0])
        verify += overhead
        bound = low * min(ys) + overhead if low >= 0 and min(ys) >= 0 else -math.inf  # rounding is monotone
        verify = floored(verify, bound)
        return floored(draft + verify, draft + max(bound, MIN_SECONDS)), verify, (draft,)

    def _price(self, requests: int, tokens: Tokens, which: int) -> Any:
        """This step's price at R (which: 0 the step, 1 verification, 2 drafting): looked up in this step's
        table at R where tokens are counts below LIMIT (an int, an int array), else priced the same way."""
        if self._unseen:
            self._catch_up()
        top = -1
        if isinstance(tokens, np.ndarray):
            if tokens.dtype.kind in "iu" and tokens.size:  # their OR is < 2**k iff they all are, < 0 if one is
                top = tokens.item() if tokens.size == 1 else int(np.bitwise_or.reduce(tokens, axis=None))
        elif isinstance(tokens, (int, np.integer)):
            top = tokens = int(tokens)
        if 0 <= top < LIMIT:
            prices = self._prices.get(requests)
            if prices is None or prices[0].size <= top or self._tables_of is not self.prior:
                prices = self._prices[requests] = self._build(*self._prior_table(requests, top + 1))
            return prices[which][tokens] if isinstance(tokens, np.ndarray) else float(prices[which][tokens])
        counts = np.asarray(tokens).reshape(-1)
        prior = np.asarray(self._prior(requests, counts), dtype=np.float64)
        buckets, (*_, draft, _, row) = bucket(counts), self._prior_table(requests, 1)
        price = self._build(prior, buckets, np.arange(buckets.max(initial=0) + 1.0), draft, -math.inf, row)[which]
        return price.reshape(np.shape(tokens)) if isinstance(tokens, np.ndarray) else float(price[0])

    def seconds(self, requests: int, tokens: Tokens) -> float | np.ndarray:
        """Predicted seconds of one decode step; elementwise over an array of token counts."""
        return self._price(requests, tokens, 0)

    @property
    def load_factor(self) -> float:
        """Observed/prior step time over the last `horizon` steps (median; 1.0 = as measured)."""
        self._catch_up()
        return self.step_ratios.level(self.steps)

    def to_dict(self) -> dict[str, Any]:
        live: dict[str, Any] = {"load_factor": self.load_factor, "observed_steps": self.steps,
                                "cells": len(self.step_ratios.cells)}
        if self.SPLIT:
            live.update(draft_factor=self.draft_factor,
                        verify_factor=self.verify_ratios.level(self.steps),
                        overhead_ms=1e3 * self.overhead.level(self.steps))
        return {"prior": self.prior.to_dict(), "live": live}


class LiveSplitStepCost(LiveStepCost):
    """Over a prior that prices drafting and verification apart: each part scaled by what was
    learned for it, plus the per-step overhead, so the drafting gate sees a slowed drafter or target."""

    SPLIT = True

    @property
    def draft_factor(self) -> float:
        """Observed/prior drafting time over recent drafting steps (median; 1.0 = as measured)."""
        self._catch_up()
        return self.draft_ratios.level(self.steps)

    def draft_seconds(self, requests: int) -> float:
        return self._price(requests, 0, 2)

    def verify_seconds(self, requests: int, tokens: Tokens) -> float | np.ndarray:
        """The target's verification and the step's fixed overhead (plain decoding pays both)."""
        return self._price(requests, tokens, 1)
