"""Greedy chain verification and the packed gather, one row and several: a draft survives while it equals
the target's argmax and every earlier one survived; the bonus is the argmax after the last survivor; the
gather hands back copies (the graphs' output buffers are reused the next step)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.runtime.chain_verifier import verify_chains
from dspark.runtime.step_batch import StepBatch


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_rows_accept_the_drafts_that_match_the_argmax_chain(rows):
    rng = np.random.default_rng(rows)
    for _ in range(200):
        gamma, vocab = int(rng.integers(1, 8)), 11
        logits = rng.standard_normal((rows, gamma + 1, vocab)).astype(np.float32)
        best = logits.argmax(-1)
        lengths = rng.integers(0, gamma + 1, rows)
        matching = rng.integers(0, gamma + 1, rows)  # leading drafts equal to the argmax
        drafts = (best[:, :gamma] + 1) % vocab
        for r in range(rows):
            drafts[r, : matching[r]] = best[r, : matching[r]]
        batch = StepBatch.chains(rng.integers(0, vocab, rows), drafts, lengths, np.zeros(rows, np.int64))
        width = batch.width
        accepted, bonus = verify_chains(batch, logits[:, :width], None, None, [0.0] * rows, [None] * rows)
        want = np.minimum(matching, lengths)
        assert accepted.tolist() == want.tolist()
        assert bonus.tolist() == best[np.arange(rows), want].tolist()
        assert accepted.dtype == bonus.dtype == np.int64


@pytest.mark.parametrize("counts", [[3], [2, 0, 4], [1, 1, 1], [1, 2, 1]])
def test_gather_packs_copies_of_each_rows_first_counts(counts):
    values = np.arange((len(counts) + 1) * 5 * 2, dtype=np.float32).reshape(len(counts) + 1, 5, 2)  # a spare row
    batch = StepBatch.chains(np.zeros(len(counts), np.int64), None, np.zeros(len(counts), np.int64),
                             np.zeros(len(counts), np.int64))
    packed = batch.gather(values, np.array(counts))
    want = np.concatenate([values[r, :n] for r, n in enumerate(counts)])
    values[...] = -1  # the buffer is reused: what was gathered must not change with it
    assert np.array_equal(packed, want)
