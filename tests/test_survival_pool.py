"""The drafting gate's survival pool reads exactly like the deque it replaced: the same rows, oldest first,
after any mix of appends, 2-D extends (longer than the pool too), row-by-row extends and clears."""

from __future__ import annotations

from collections import deque

import numpy as np

from dspark.runtime.survival_pool import SurvivalPool


def test_the_pool_holds_what_a_bounded_deque_holds():
    rng = np.random.default_rng(0)
    pool, model = SurvivalPool(5, 3), deque(maxlen=5)
    for _ in range(400):
        op = rng.integers(4)
        if op == 0:
            row = rng.random(3)
            pool.append(row)
            model.append(row)
        elif op == 1:
            rows = rng.random((int(rng.integers(0, 8)), 3))
            pool.extend(rows)
            model.extend(rows)
        elif op == 2:
            rows = [rng.random(3) for _ in range(int(rng.integers(0, 4)))]
            pool.extend(iter(rows))
            model.extend(rows)
        elif rng.random() < 0.2:
            pool.clear()
            model.clear()
        assert len(pool) == len(model) and bool(pool) == bool(model)
        expected = np.stack(model) if model else np.zeros((0, 3))
        assert np.array_equal(pool.rows(), expected)
        assert all(np.array_equal(a, b) for a, b in zip(pool, model, strict=True))
