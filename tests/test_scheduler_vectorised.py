"""The vectorised Algorithm 1 takes exactly the decisions of the one-by-one scan (the paper's
listing), on thousands of random inputs: random survivals with ties and zeros, random cost tables
and linear cost models, chains and ragged rows."""

from __future__ import annotations

import numpy as np
import torch

from dspark.export.cost_table import CostTable
from dspark.runtime.cost_model import StepCostModel
from dspark.runtime.prefix_scheduler import admit_by_throughput, prefix_schedule


def scalar_algorithm1(survivals, theta):
    """Algorithm 1 as listed: sort, then admit one candidate at a time until Θ stops rising."""
    requests = len(survivals)
    candidates = sorted(((a, r, j) for r, row in enumerate(survivals) for j, a in enumerate(row) if a > 0),
                        key=lambda c: (-c[0], c[1], c[2]))
    lengths, tau, tokens = [0] * requests, float(requests), requests
    best = theta(tau, tokens) if requests else 0.0
    considered = 0
    for a, r, j in candidates:
        considered += 1
        candidate = theta(tau + a, tokens + 1)
        if candidate <= best:
            break
        best, tau, tokens, lengths[r] = candidate, tau + a, tokens + 1, j + 1
    return tuple(lengths), tau, best, considered


def random_survivals(rng: np.random.Generator, requests: int, gamma: int) -> np.ndarray:
    c = rng.choice([rng.uniform(0, 1, (requests, gamma)), rng.choice([0.5, 0.9, 0.0, 1.0], (requests, gamma))])
    return np.cumprod(c, axis=1)  # non-increasing along each row; ties and zeros included


def random_cost(rng: np.random.Generator):
    if rng.random() < 0.5:
        return StepCostModel(*rng.uniform(0, 2e-3, 3))
    batches = tuple(sorted(rng.choice(np.arange(1, 65), rng.integers(1, 5), replace=False).tolist()))
    buckets = tuple(sorted(rng.choice(np.arange(1, 257), rng.integers(1, 7), replace=False).tolist()))
    verify = tuple(tuple(float(v) if b >= r or k == 0 else None for k, (b, v) in
                         enumerate(zip(buckets, rng.uniform(1e-4, 1e-2, len(buckets)), strict=True)))
                   for r in batches)
    return CostTable(batches, buckets, verify, tuple(rng.uniform(0, 5e-3, len(batches))))


def test_vectorised_chains_take_the_scalar_decisions():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        requests, gamma = int(rng.integers(1, 17)), int(rng.integers(1, 9))
        survivals, cost = random_survivals(rng, requests, gamma), random_cost(rng)
        got = prefix_schedule(torch.from_numpy(survivals), cost.seconds)
        want = scalar_algorithm1(survivals.tolist(),
                                 lambda tau, tokens, c=cost, r=requests: tau / float(c.seconds(r, tokens)))
        assert got.lengths == want[0] and got.considered == want[3]
        assert got.expected_accepts == want[1] and got.expected_throughput == want[2]


def test_vectorised_ragged_rows_take_the_scalar_decisions():
    rng = np.random.default_rng(1)
    for _ in range(1000):
        rows = [np.cumprod(rng.uniform(0.2, 1, int(rng.integers(0, 12)))).tolist() for _ in range(rng.integers(1, 6))]
        sps = rng.uniform(50, 100, 200).cumsum()[::-1]  # steps/s falling with the tokens verified

        def theta(tau, tokens, sps=sps):
            return tau * sps[np.asarray(tokens)]

        got = admit_by_throughput(rows, theta)
        want = scalar_algorithm1(rows, lambda tau, tokens, sps=sps: tau * float(sps[tokens]))
        assert (got.lengths, got.expected_accepts, got.expected_throughput, got.considered) == want


def scalar_by_width(survivals, theta):
    """Algorithm 1 over a padded verification, as `admit_by_width` states it: depth d (every row's d-th draft)
    adds Σ_r a_{r,d} to τ for R more verified tokens; depths go in order while Θ rises, a depth no row can
    fill (all survivals 0) stops the scan as a drop does; no row verifies past its own drafts (survivals > 0)."""
    requests, gamma = len(survivals), len(survivals[0])
    tau, best, depth = float(requests), theta(float(requests), requests), 0
    for d in range(gamma):
        column = [row[d] for row in survivals]
        candidate = theta(tau + sum(column), requests * (d + 2))
        if candidate <= best or max(column) <= 0:
            break
        tau, best, depth = tau + sum(column), candidate, d + 1
    return tuple(min(depth, sum(a > 0 for a in row)) for row in survivals), tau, best, min(depth + 1, gamma)


def test_vectorised_padded_chains_take_the_scalar_decisions():
    rng = np.random.default_rng(2)
    for i in range(3000):
        requests, gamma = int(rng.integers(1, 17)), int(rng.integers(1, 9))
        survivals, cost = random_survivals(rng, requests, gamma), random_cost(rng)
        if i % 10 == 0:  # every draft survives and a step costs its tokens: Θ ties at every depth (a drop)
            def seconds(r, tokens):
                return 1e-3 * np.asarray(tokens, dtype=np.float64)

            survivals = np.ones_like(survivals)
        else:
            seconds = cost.seconds
        got = prefix_schedule(torch.from_numpy(survivals), seconds, padded=True)
        want = scalar_by_width(survivals.tolist(),
                               lambda tau, tokens, s=seconds, r=requests: tau / float(s(r, tokens)))
        assert got.lengths == want[0] and got.considered == want[3]
        assert np.isclose(got.expected_accepts, want[1], rtol=1e-12)
        assert np.isclose(got.expected_throughput, want[2], rtol=1e-12)


def test_a_padded_depth_past_a_rows_own_drafts_leaves_that_row_at_its_drafts():
    """A DSpark row (γ = 3) beside a prompt-lookup copy of 6: the depth the copy fills is no length of the row's,
    whose slots past γ hold no draft (a sampled row's rejection rule would read a law never drawn from)."""
    survivals = np.array([[0.99, 0.98, 0.97, 0.96, 0.95, 0.94], [0.9, 0.8, 0.7, 0.0, 0.0, 0.0]])
    decision = prefix_schedule(survivals, lambda r, tokens: 1e-3 + 1e-6 * np.asarray(tokens), padded=True)
    assert decision.lengths == (6, 3)
