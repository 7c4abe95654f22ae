"""The accumulators behind the serving metrics' quality dimension, fed a whole step at a time on the engine's
loop thread: a numpy histogram (`BatchHistogram`), drafts verified and accepted per block position
(`verification_counts`), and a running ECE of the calibrated confidences (`RunningECE`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class BatchHistogram:
    """A histogram fed many values at once (numpy bucket counts), for the per-step and per-request batches that
    would otherwise cost one prometheus observe() each on the loop thread. Buckets are upper bounds (le)."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(self.bounds.size + 1, dtype=np.int64)  # the last one: above every bound
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, values: Any) -> None:
        v = np.asarray(values, dtype=np.float64).ravel()
        if not v.size:
            return
        counts = np.bincount(np.searchsorted(self.bounds, v, side="left"), minlength=self.counts.size)
        with self._lock:
            self.counts += counts
            self.sum += float(v.sum())

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        with self._lock:
            cumulative, total = np.cumsum(self.counts), self.sum
        buckets = [(floatToGoString(b), float(c)) for b, c in zip(self.bounds, cumulative[:-1], strict=True)]
        return HistogramMetricFamily(name, doc, buckets=[*buckets, ("+Inf", float(cumulative[-1]))], sum_value=total)


def verification_counts(lengths: np.ndarray, accepted: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block position j: how many requests verified a draft there (length > j) and how many had it
    accepted (accepted drafts > j)."""
    cols = np.arange(slots)
    verified = (lengths[:, None] > cols[None, :]).sum(axis=0)
    accepted = (np.minimum(accepted, lengths)[:, None] > cols[None, :]).sum(axis=0)
    return verified.astype(np.int64), accepted.astype(np.int64)


class RunningECE:
    """ECE (equal-width bins, as engines/calibration.py) of the calibrated prefix survival a_j = prod_{i<=j}
    sigma(c_i/T_i) against "drafts 0..j all accepted", over every verified (request, position) so far. Kept as
    per-(position, bin) counts and sums of (label - prediction): an update is O(R*gamma), a read O(gamma*bins).
    Unverified positions have no outcome and are left out. A decayed copy (half-life in samples) follows drift."""

    def __init__(self, slots: int, bins: int = 15, half_life: float = 2000.0) -> None:
        self.slots, self.bins, self.half_life = slots, bins, half_life
        self.count = np.zeros((slots, bins))
        self.gap = np.zeros((slots, bins))
        self.recent_count = np.zeros((slots, bins))
        self.recent_gap = np.zeros((slots, bins))
        self._lock = threading.Lock()

    def update(self, logits: np.ndarray, temperatures: np.ndarray | None, lengths: np.ndarray,
               accepted: np.ndarray) -> None:
        """logits [R, gamma] pre-sigmoid; lengths [R] drafts verified; accepted [R] drafts accepted."""
        logits = np.asarray(logits, dtype=np.float64)[:, : self.slots]
        width = logits.shape[1]
        t = np.ones(width) if temperatures is None else np.asarray(temperatures, dtype=np.float64)[:width]
        probs = np.cumprod(0.5 * (1.0 + np.tanh(0.5 * logits / t[None, :])), axis=1)  # overflow-free sigmoid
        cols = np.arange(width)[None, :]
        mask = (cols < np.asarray(lengths)[:, None]) & np.isfinite(probs)
        if not mask.any():
            return
        labels = (np.asarray(accepted)[:, None] > cols).astype(np.float64)
        index = np.minimum((np.where(mask, probs, 0.0) * self.bins).astype(np.int64), self.bins - 1)
        flat = (cols * self.bins + index)[mask]
        size = self.slots * self.bins
        count = np.bincount(flat, minlength=size).reshape(self.slots, self.bins)
        gap = np.bincount(flat, weights=(labels - probs)[mask], minlength=size).reshape(self.slots, self.bins)
        decay = 0.5 ** (flat.size / self.half_life)
        with self._lock:
            self.count += count
            self.gap += gap
            self.recent_count *= decay
            self.recent_gap *= decay
            self.recent_count += count
            self.recent_gap += gap

    def values(self) -> dict[str, Any]:
        """Pooled ECE (all positions' predictions in one set of bins), the decayed one, per position, samples."""
        with self._lock:
            count, gap, recent_count, recent_gap = (a.copy() for a in
                                                    (self.count, self.gap, self.recent_count, self.recent_gap))
        per_position = [_ece(c, g) for c, g in zip(count, gap, strict=True)]
        return {"ece": _ece(count.sum(0), gap.sum(0)), "recent": _ece(recent_count.sum(0), recent_gap.sum(0)),
                "per_position": per_position, "samples": float(count.sum())}


def _ece(count: np.ndarray, gap: np.ndarray) -> float | None:
    n = count.sum()
    return float(np.abs(gap).sum() / n) if n > 0 else None
