"""One target call's rows, described once per step: what the runner feeds and the scheduler prices.

Request r runs `counts[r]` new tokens at positions `starts[r] .. starts[r] + counts[r] - 1` on
top of its `starts[r]` committed KV entries: at prefill its prompt (starts 0), at verification
its anchor then its ℓ_r drafts (counts 1 + ℓ_r). The graphs take the rows right-padded to the
widest, `ids` [R, W]; `cu_counts` are the cumulative offsets of the same tokens packed with no
padding (vLLM's flattened metadata), so `tokens` is what was asked for and `padded_tokens` what
the padded call computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepBatch:
    ids: np.ndarray  # [R, W] int64, row r's real tokens first, then zeros
    starts: np.ndarray  # [R] int64 committed KV entries of each row
    counts: np.ndarray  # [R] int64 real tokens of each row, 1 <= counts <= W
    cu_counts: np.ndarray  # [R + 1] int64, cu_counts[r] = Σ_{i<r} counts[i]

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def tokens(self) -> int:
        return int(self.cu_counts[-1])

    @property
    def padded_tokens(self) -> int:
        return self.ids.size

    @property
    def valid(self) -> np.ndarray:
        """[R, W] bool: which entries of `ids` are real tokens."""
        return np.arange(self.width)[None, :] < self.counts[:, None]

    @property
    def positions(self) -> np.ndarray:
        """[R, W] int64: each token's position (padding continues its row's count)."""
        return self.starts[:, None] + np.arange(self.width)[None, :]

    def attention_mask(self) -> np.ndarray:
        """[R, 1, W, max(starts) + W] bool for the plain graphs (True = may attend): each token
        sees its row's committed entries and, causally, its row's real new tokens."""
        past = int(self.starts.max())
        col = np.arange(past + self.width)[None, None, :]
        row = np.arange(self.width)[None, :, None]
        sees_past = col < self.starts[:, None, None]
        new = col - past  # index of the new token in that column
        sees_new = (new >= 0) & (new <= row) & (new < self.counts[:, None, None])
        return (sees_past | sees_new)[:, None]

    @classmethod
    def build(cls, ids: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> StepBatch:
        counts = np.asarray(counts, dtype=np.int64)
        cu = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        return cls(np.ascontiguousarray(ids, dtype=np.int64), np.asarray(starts, dtype=np.int64), counts, cu)

    @classmethod
    def prompts(cls, prompts: Sequence[Sequence[int]]) -> StepBatch:
        """Prefill rows: each prompt from position 0."""
        counts = np.array([len(p) for p in prompts], dtype=np.int64)
        ids = np.zeros((len(prompts), int(counts.max())), dtype=np.int64)
        ids[np.arange(ids.shape[1])[None, :] < counts[:, None]] = np.concatenate([np.asarray(p) for p in prompts])
        return cls.build(ids, np.zeros(len(prompts), dtype=np.int64), counts)

    @classmethod
    def anchors(cls, anchors: np.ndarray, starts: np.ndarray) -> StepBatch:
        """Each row's anchor alone (plain decoding, a declined step: most steps under load), from int64
        arrays [R]; built with as few numpy calls as it takes, each a microsecond or more on this path."""
        rows = len(anchors)
        return cls(anchors.reshape(rows, 1), starts, np.ones(rows, np.int64), np.arange(rows + 1, dtype=np.int64))

    @classmethod
    def chains(cls, anchors: np.ndarray, drafts: np.ndarray | None, lengths: np.ndarray,
               starts: np.ndarray) -> StepBatch:
        """Verification rows: anchor [R], then the first lengths[r] of drafts [R, γ] (None: no drafts)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        width = 1 + int(lengths.max()) if lengths.size else 1
        if width == 1:
            return cls.anchors(np.asarray(anchors, dtype=np.int64), np.asarray(starts, dtype=np.int64))
        ids = np.zeros((len(anchors), width), dtype=np.int64)
        ids[:, 0] = anchors
        if width > 1 and drafts is not None:
            keep = np.arange(width - 1)[None, :] < lengths[:, None]
            ids[:, 1:] = np.where(keep, drafts[:, : width - 1], 0)
        return cls.build(ids, starts, 1 + lengths)

    def gather(self, values: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Rows of `values` [R, W, ...] packed: the first counts[r] of row r, row after row -> [Σ counts, ...]."""
        counts = np.asarray(counts, dtype=np.int64)
        if len(counts) == 1:  # one row (a single stream): a slice, copied (values is a reused buffer)
            return values[0, : counts[0]].copy()
        if counts.max(initial=0) == 1 and counts.min() == 1:  # one each (a step without drafts): a column
            return values[: len(counts), 0].copy()
        rows = np.repeat(np.arange(len(counts)), counts)
        cols = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
        return values[rows, cols]
