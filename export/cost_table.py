"""The measured cost table behind SPS: step seconds as a function of (requests R, tokens B).

On CPU a step's time depends on both the number of requests R and the number of verified tokens
B = Σ_r (1 + ℓ_r), so the table is two-dimensional:

    verify[i][k]  median seconds of one target verification call with R = batches[i] rows and
                  B = buckets[k] tokens (shape [R, ceil(B / R)]); None where B < R
    draft[i]      median seconds of drafting for R = batches[i] rows (backbone + greedy head)

    seconds(R, B) = draft(R) + verify(R, B)      SPS(R, B) = 1 / seconds(R, B)

Timing noise on a shared machine can make a larger bucket measure faster than a smaller one;
lookups use the running minimum over B from the largest bucket down, the stored measurements stay raw.
Verifying B tokens costs no more than verifying B' > B (it could be padded to B'), and noise only adds
time (a preempted or cold call is slower, never faster), so where a smaller bucket measured slower, it is
the smaller one that was inflated. (Until 2026-12-08 the running maximum up from the smallest bucket: a
first cell measured cold, 1.1 ms against 0.69 ms at 2 and 4 tokens on a fresh AMD EPYC machine, then priced
every plain step at 1.1 ms where it took 0.45, and a fresh engine's drafting gate found drafting paying beside it.)
verify(R, B) is then piecewise linear in B between measured buckets
(linear extrapolation past the last one) and piecewise linear in R between measured batch sizes, so
the prefix scheduler sees a cost that rises with every admitted token rather than in steps. Past
the largest measured batch R_max, verification keeps R_max's cost along B and adds what a row costs beyond
its tokens (its own past's attention), the median over buckets of the last two batch rows' difference per
row: verify(R, B) = verify(R_max, B) + (R − R_max)·row_cost, row_cost ≥ 0. A step's cost goes mostly with
its tokens B: on the demo engine (R_max = 8) a plain step of 64 rows took 6.0 ms against 5.4 ms measured for
8 rows and 64 tokens, and 512 tokens over 64 rows 38 ms against 37 ms so predicted. Scaling the work as
R / R_max copies of R_max rows priced that plain step at 12.7 ms and the wide one at 41 ms: verifying 8x the
tokens looked 3.3x the price where it was 6.4x, and Algorithm 1 verified too much past R_max (and the 100M
stand-in's 16 rows, verified 64 tokens wide, ran below fixed γ = 2). A one-batch table has no row cost to read
and keeps the copies rule. Drafting scales with its rows: draft(R) = (R / R_max)·draft(R_max).
`seconds(requests, tokens)` has the signature of the runtime's `StepCostModel.seconds`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

MIN_SECONDS = 1e-9
Tokens = int | np.ndarray  # one token count, or many (the scheduler prices all its candidates at once)


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float | np.ndarray):
    """Piecewise-linear y(x) through (xs, ys) (xs increasing), extrapolating the end segments.
    x may be an array: elementwise, with the same arithmetic as for a scalar."""
    last = len(xs) - 2
    if not isinstance(x, np.ndarray):
        if last < 0:
            return ys[0]
        i = min(max(bisect_right(xs, x) - 1, 0), last)
        x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    else:
        xa, ya = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
        if last < 0:
            return np.full(x.shape, ya[0])
        i = np.minimum(np.maximum(np.searchsorted(xa, x, side="right") - 1, 0), last)
        x0, x1, y0, y1 = xa[i], xa[i + 1], ya[i], ya[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def at_least(value: float | np.ndarray, floor: float) -> float | np.ndarray:
    """max(value, floor), elementwise for arrays (a plain float stays a plain float)."""
    return np.maximum(value, floor) if isinstance(value, np.ndarray) else max(value, floor)


@dataclass(frozen=True)
class CostTable:
    batches: tuple[int, ...]  # R values measured, increasing
    buckets: tuple[int, ...]  # B values measured, increasing
    verify: tuple[tuple[float | None, ...], ...]  # [len(batches)][len(buckets)] seconds
    draft: tuple[float, ...]  # [len(batches)] seconds

    def __post_init__(self) -> None:
        if not self.batches or not self.buckets:
            raise ValueError("a cost table needs at least one batch size and one bucket")
        if len(self.verify) != len(self.batches) or len(self.draft) != len(self.batches):
            raise ValueError(f"cost table: {len(self.batches)} batch sizes but {len(self.verify)} verify rows "
                             f"and {len(self.draft)} draft entries")
        for r, row in zip(self.batches, self.verify, strict=True):
            if len(row) != len(self.buckets):
                raise ValueError(f"cost table: batch {r} has {len(row)} entries for {len(self.buckets)} buckets")
            if not any(v is not None for v in row):
                raise ValueError(f"cost table: batch {r} has no measured bucket")
        rows = []
        for row in self.verify:
            points = [(b, v) for b, v in zip(self.buckets, row, strict=True) if v is not None]
            seconds = list(accumulate((v for _, v in reversed(points)), min))[::-1]  # never dearer than more tokens
            rows.append(([float(b) for b, _ in points], seconds))
        object.__setattr__(self, "_rows", tuple(rows))  # lookup points, built once (the table is frozen)
        object.__setattr__(self, "_row_cost", self._measured_row_cost())

    def _measured_row_cost(self) -> float | None:
        """Seconds a row adds beyond its tokens past R_max (module docstring); None where no bucket of the last
        two batch rows was measured in both (a one-batch table)."""
        if len(self.batches) < 2:
            return None
        (previous, last), rows = self.batches[-2:], len(self.batches)
        per_row = [(float(self._row(rows - 1, b)) - float(self._row(rows - 2, b))) / (last - previous)
                   for b, before, after in zip(self.buckets, self.verify[-2], self.verify[-1], strict=True)
                   if before is not None and after is not None]  # where both rows were measured
        return max(float(np.median(per_row)), 0.0) if per_row else None

    def _row(self, i: int, tokens: Tokens):
        xs, ys = self._rows[i]
        return interpolate(xs, ys, tokens)

    def verify_seconds(self, requests: int, tokens: Tokens):
        """Piecewise linear in R between the two measured batch sizes around `requests` (only
        those two rows are evaluated), and in B along each row."""
        largest = self.batches[-1]
        if requests > largest:
            if self._row_cost is None:  # one batch measured: R / R_max copies of its rows, each its share of B
                scale = requests / largest
                return at_least(scale * self._row(len(self.batches) - 1, tokens / scale), MIN_SECONDS)
            extra = (requests - largest) * self._row_cost  # R_max's cost along B, and the rows beyond
            return at_least(self._row(len(self.batches) - 1, tokens) + extra, MIN_SECONDS)
        if len(self.batches) == 1:
            per_requests = self._row(0, tokens)
        else:
            i = min(max(bisect_right(self.batches, requests) - 1, 0), len(self.batches) - 2)
            (x0, x1), y0, y1 = self.batches[i : i + 2], self._row(i, tokens), self._row(i + 1, tokens)
            per_requests = y0 + (y1 - y0) * (requests - x0) / (x1 - x0)  # as `interpolate` computes it
        return at_least(per_requests, MIN_SECONDS)

    def draft_seconds(self, requests: int) -> float:
        if requests > self.batches[-1]:
            return requests / self.batches[-1] * self.draft[-1]
        return max(interpolate(self.batches, self.draft, requests), 0.0)

    def seconds(self, requests: int, tokens: Tokens):
        """Predicted seconds of one decode step (drafting + verification); elementwise over an
        array of token counts."""
        return at_least(self.draft_seconds(requests) + self.verify_seconds(requests, tokens), MIN_SECONDS)

    def sps(self, requests: int, tokens: Tokens):
        return 1.0 / self.seconds(requests, tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"batches": list(self.batches), "buckets": list(self.buckets),
                "verify_seconds": [list(row) for row in self.verify], "draft_seconds": list(self.draft)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        return cls(tuple(data["batches"]), tuple(data["buckets"]),
                   tuple(tuple(row) for row in data["verify_seconds"]), tuple(data["draft_seconds"]))
