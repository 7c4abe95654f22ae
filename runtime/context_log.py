"""Plain steps' context rows, kept once a step over the active rows instead of once a row a step.

A step that verifies anchors only (plain decoding, a declined step) still owes the drafter each row's context
features. Handing them out one `add_context` a row a step, right after the target's call with the host caches
cold, cost 15 µs a step at 4 requests and 66 µs at 64 (demo engine), 1-1.5 % of a plain step. The log keeps the
step's [R, F] block instead, in a layout fixed when it starts (row r of every block: the request that was active
row r then, its `log_row`), and a map from the active rows to that layout:

- a row leaving moves the last active row into its place (`vacate`); the map follows, the blocks stay. A
  finished request's rows are dropped, a request leaving unfinished (a swap to the host tier) takes its own;
- before a row drafts or verifies drafts, or rows join, `hand` gives every active row its rows, in step order
  (rows joining have no place in the layout, so the log ends there).

At 1024 requests of a declined sweep handing the whole log out at each row's departure had cost ~170 ms of a
6.5 s run, stacking rows that nobody would read. Each row counts its logged rows in its backlog (`logged`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .request_state import RunningRequest


class ContextLog:
    """The engine's log (module docstring): empty until a plain step logs, empty again once handed out."""

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] | None = None  # [rows at the start, F] a step; None: no log
        self.layout = np.arange(0)  # active row -> its row in the blocks
        self.moved = False  # a row left since the start (blocks are then scattered through `layout`)

    def log(self, features: np.ndarray, active: Sequence[RunningRequest]) -> None:
        """A plain step's context rows [R, F], row r the active row r's (a view: the buffer is the next step's)."""
        if self.blocks is None:
            self.blocks, self.layout, self.moved = [], np.arange(len(active)), False
            for row, a in enumerate(active):
                a.logged, a.log_row = self.blocks, row
        if not self.moved:
            self.blocks.append(features.copy())
            return
        block = np.empty((self.blocks[0].shape[0], *features.shape[1:]), features.dtype)
        block[self.layout] = features
        self.blocks.append(block)

    def vacate(self, row: int, leaving: RunningRequest) -> None:
        """Active row `row` (`leaving`) leaves and the last active row takes its place."""
        if self.blocks is None:
            return
        if leaving.logged is not None:
            leaving.logged = None
            if not leaving.result.finish_reason:  # unfinished (swapped out): it takes its rows along
                leaving.add_context(np.stack([b[leaving.log_row] for b in self.blocks]))
        self.layout[row] = self.layout[-1]
        self.layout, self.moved = self.layout[:-1], True
        if not self.layout.size:
            self.blocks = None

    def hand(self, active: Sequence[RunningRequest]) -> None:
        """Every active row's logged rows to its pending context, in step order; the log ends."""
        blocks, self.blocks = self.blocks, None
        if blocks is None:
            return
        by_row = np.stack(blocks, axis=1)  # [rows at the start, steps, F]
        for a in active:
            rows, a.logged = by_row[a.log_row], None
            a.add_context(rows)
