"""The step cost model behind SPS(B): seconds per decode step as a function of load.

On CPU a step's time depends on both the number of requests R (per-request work: KV traffic,
the drafter forward, the sequential head, Python bookkeeping) and the number of verified
tokens B = Σ(1 + ℓ_r) (the target's matmuls). A table indexed by B alone would mix the two, so
the model is a 2-D linear fit

    t(R, B) = intercept + per_request·R + per_token·B   (seconds),

fitted by least squares on timed steps. SPS(B) for a step with R requests is 1 / t(R, B).
An engine directory carries a measured table instead (`dspark.export.cost_table.CostTable`,
which `Runtime.load` hands the scheduler); a plain export directory has none, so `Runtime`
profiles this model at start-up (`profiling.profile_step_cost`). Either way
`BatchEngine.refit_cost_model` can refit it from the live step timings (`StepCostModel.fit`),
which is how the measured load of the machine enters the scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from dspark.export.cost_table import at_least


class StepCost(Protocol):
    """What the scheduler needs: whole-step seconds at R requests and B verified tokens. The
    fitted `StepCostModel` and an engine's measured table (`dspark.export.cost_table.CostTable`) both are."""

    def seconds(self, requests: int, tokens: int | np.ndarray) -> float | np.ndarray: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StepCostModel:
    intercept: float  # seconds
    per_request: float  # seconds per active request
    per_token: float  # seconds per verified token

    def seconds(self, requests: int, tokens: int | np.ndarray):
        """Elementwise over an array of token counts (the scheduler prices all candidates at once)."""
        return at_least(self.intercept + self.per_request * requests + self.per_token * tokens, 1e-9)

    def to_dict(self) -> dict[str, float]:
        return {"intercept_ms": 1e3 * self.intercept, "per_request_ms": 1e3 * self.per_request,
                "per_token_ms": 1e3 * self.per_token}

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]]) -> StepCostModel:
        """samples: (requests, tokens, seconds). Coefficients are clamped at >= 0 (a cost)."""
        if len(samples) < 3:
            raise ValueError(f"a cost fit needs at least 3 timed steps, got {len(samples)}")
        x = torch.tensor([[1.0, r, b] for r, b, _ in samples], dtype=torch.float64)
        y = torch.tensor([[s] for _, _, s in samples], dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y, driver="gelsd").solution.flatten().clamp(min=0.0).tolist()
        return cls(*coef)


def time_median(call: Callable[[], object], *, warmup: int = 1, repeats: int) -> float:
    """Median wall-clock seconds of `repeats` calls after `warmup` untimed calls."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return sorted(times)[len(times) // 2]
