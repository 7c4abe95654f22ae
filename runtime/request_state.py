"""What the engine keeps of one request between steps: its result so far, its settings, its sampler, where
its committed KV ends, and the context rows its drafter has not seen yet. Lives in a queue, a slot row,
or the host tier (`kv_tiers`), and is all a swap moves besides the KV."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .prompt_lookup import LookupState
from .stats import RequestResult


@dataclass(eq=False)
class RunningRequest:
    """One request in a BatchEngine (queued, running or swapped out); equal only to itself (the engine compares
    its active rows from step to step by identity)."""

    result: RequestResult
    max_new_tokens: int
    temperature: float
    stop: frozenset[int]
    generator: torch.Generator | None  # re-seeded every round (sampling.round_seed); None when greedy
    seed: int = 0
    start: int = 0  # anchor position = committed target KV length
    anchor: int = 0
    scanned: int = 0  # output tokens already searched for a stop token
    pending: list[np.ndarray] = field(default_factory=list)  # [n, F] context rows the drafter has not seen
    pending_rows: int = 0  # their count, kept as they come: read for every row every step
    fed: int = 0  # of those, rows a drafter before a restart had seen: the gate prices backlogs without them
    lookup: LookupState | None = None  # its n-gram index and estimates, under prompt lookup (prompt_lookup)

    @property
    def backlog(self) -> int:
        return self.pending_rows - self.fed

    def add_context(self, rows: np.ndarray) -> None:
        """Context rows [n, F] the drafter has not seen yet."""
        self.pending.append(rows)
        self.pending_rows += len(rows)

    def take_context(self) -> list[np.ndarray]:
        """Every pending chunk, handed to the drafter: the backlog is then empty."""
        chunks, self.pending, self.pending_rows, self.fed = self.pending, [], 0, 0
        return chunks
