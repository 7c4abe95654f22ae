"""The drafting gate's priced path, Θ_draft, against a numpy statement of its module docstring: padded (depth by
depth over the pool's mean survivals) and packed (candidates by descending survival), survivals scaled by the
realised acceptance, ties included."""

from __future__ import annotations

import numpy as np
import pytest
from test_drafting_gate import GAMMA, SplitCost

from dspark.runtime.drafting_gate import DraftingGate


class PerToken(SplitCost):
    """Verification that costs ~15 µs a token and nothing else."""

    def __init__(self) -> None:
        super().__init__(0.0, 2.0**-16)  # a power of two: every Θ of the flat path is exactly 2**16

    def verify_seconds(self, requests: int, tokens):
        return self.per_token * tokens


def _reference_throughputs(pool: np.ndarray, requests: int, draft: float, cost: SplitCost, scale: float,
                           padded: bool) -> float:
    """Θ_draft as the module docstring states it, in numpy: the path over R rows like the pool's (padded: depth
    by depth over the pool's mean survivals), every survival times `scale` (at most 1), up to its first drop."""
    if padded:
        depths = np.minimum(pool.mean(axis=0) * scale, 1.0)
        depths = depths[: int(np.count_nonzero(depths > 0))]
        tau = requests * (1.0 + np.concatenate(([0.0], np.cumsum(depths))))
        tokens = requests * (1 + np.arange(depths.size + 1))
    else:
        ranked = np.minimum(-np.sort(-pool[pool > 0]) * scale, 1.0)
        per = requests / len(pool)
        cumulative = np.concatenate(([0.0], np.cumsum(ranked)))
        if per >= 1.0:
            tau, tokens = requests + per * cumulative, requests + np.rint(per * np.arange(ranked.size + 1))
        else:
            at = np.rint(np.arange(int(ranked.size * per) + 1) / per).astype(np.int64)
            tau, tokens = requests + per * cumulative[at], requests + np.arange(at.size)
    theta = tau / (draft + cost.verify_seconds(requests, tokens))
    drops = np.flatnonzero(theta[1:] <= theta[:-1])
    return float(theta[drops[0]] if drops.size else theta[-1])


@pytest.mark.parametrize("padded", [True, False])
def test_the_gates_path_is_the_docstrings(padded):
    """On random pools, request counts, costs and realised-acceptance scales (ties from a flat cost
    included), Θ_draft equals the numpy statement of the path it prices."""
    rng = np.random.default_rng(5 + padded)
    for i in range(300):
        gate = DraftingGate(SplitCost(1e-4, float(rng.uniform(0, 2e-4))), block_size=GAMMA, padded=padded)
        rows = rng.uniform(0.05, 1.0, (int(rng.integers(1, 65)), GAMMA))
        rows[rng.random(len(rows)) < 0.2, int(rng.integers(1, GAMMA)):] = 0.0  # rows that end early
        gate.pool.extend(np.cumprod(rows, axis=1))
        requests, scale = int(rng.integers(1, 129)), float(rng.choice([1.0, rng.uniform(0.5, 1.5)]))
        gate.accepted_drafts, gate.expected_drafts = scale * 1e6, 1e6  # acceptance_scale ~ scale
        draft = 1e-4 * requests
        if i % 7 == 0:  # every survival 1, no drafting cost, verification ∝ B: Θ flat, each step a tie (a drop)
            gate.pool.clear()
            gate.pool.extend(np.ones((4, GAMMA)))
            gate.cost, draft, requests = PerToken(), 0.0, 4 * int(rng.integers(1, 9))
            gate.accepted_drafts = gate.expected_drafts
        scale = gate.acceptance_scale
        got, plain = gate.throughputs(requests, draft, drafting=True)
        want = _reference_throughputs(gate.pool.rows(), requests, draft, gate.cost, scale, padded)
        if i % 7 == 0:
            assert got == want == 2.0**16  # the first point stands: a tie is a drop
        assert got == want and plain == requests / gate.cost.verify_seconds(requests, requests)
