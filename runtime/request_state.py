"""What the engine keeps of one request between steps: its result so far, its settings, its sampler, where
its committed KV ends, and the context rows its drafter has not seen yet. Lives in a queue, a slot row,
or the host tier (`kv_tiers`), and is all a swap moves besides the KV."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .stats import RequestResult


@dataclass
class RunningRequest:
    """One request in a BatchEngine (queued, running or swapped out)."""

    result: RequestResult
    max_new_tokens: int
    temperature: float
    stop: frozenset[int]
    generator: torch.Generator | None
    start: int = 0  # anchor position = committed target KV length
    anchor: int = 0
    scanned: int = 0  # output tokens already searched for a stop token
    pending: list[np.ndarray] = field(default_factory=list)  # [n, F] context rows the drafter has not seen
    fed: int = 0  # of those, rows a drafter before a restart had seen: the gate prices backlogs without them

    @property
    def backlog(self) -> int:
        return sum(map(len, self.pending)) - self.fed
