"""The drafting gate's pool of recent survival rows: a ring of preallocated [capacity, γ] float64 rows that
reads like the deque it replaces (oldest first: what snapshots save and restore), and hands the gate every
row in that order as one array, without stacking the rows again each step (at one request the pool changes
every step, and stacking 64 rows was most of the gate's ~100 µs of pricing there)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class SurvivalPool:
    """The last `maxlen` survival rows of width `width`, oldest first."""

    def __init__(self, maxlen: int, width: int) -> None:
        self.maxlen = maxlen
        self._rows = np.zeros((maxlen, width))  # [maxlen, γ]
        self._count = 0
        self._next = 0  # where the next row goes: once full, the oldest row

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.rows())

    def rows(self) -> np.ndarray:
        """[len, γ] every row, oldest first (a view until the ring wraps, then one copy)."""
        if self._count < self.maxlen or self._next == 0:
            return self._rows[: self._count]
        return np.concatenate((self._rows[self._next :], self._rows[: self._next]))

    def append(self, row: np.ndarray) -> None:
        self._rows[self._next] = row
        self._next = (self._next + 1) % self.maxlen
        self._count = min(self._count + 1, self.maxlen)

    def extend(self, rows: Iterable[np.ndarray]) -> None:
        """Rows in order, the oldest dropped past `maxlen` (a 2-D array goes in at once)."""
        if not isinstance(rows, np.ndarray) or rows.ndim != 2:
            for row in rows:
                self.append(row)
            return
        rows = rows[-self.maxlen :]
        slots = (self._next + np.arange(len(rows))) % self.maxlen
        self._rows[slots] = rows
        self._next = (self._next + len(rows)) % self.maxlen
        self._count = min(self._count + len(rows), self.maxlen)

    def clear(self) -> None:
        self._count = self._next = 0
