"""KV cache manager: preallocated per-request slots, rollback, admission control.

Each cache is one buffer per layer and kind, `[slots, kv_heads, max_len, head_dim]`, allocated
once. Active requests occupy rows 0..R-1 (when one leaves, the last row moves into its place),
so the batch's past is the contiguous prefix `buffer[:R]`, a view, never a gather. A slot's
length is its committed prefix; rolling back rejected tokens is just not advancing it (the
rejected rows are overwritten next step). Admission control reserves each request's worst-case
length against `max_tokens`; a request that does not fit waits in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class CapacityError(ValueError):
    """A request that can never fit the engine's capacity (too long for a slot or the budget)."""


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int


class SlotCache:
    """Per-layer key/value buffers [slots, kvh, max_len, hd] plus per-row committed lengths."""

    def __init__(self, shape: CacheShape, slots: int, max_len: int, dtype: torch.dtype = torch.float32):
        full = (slots, shape.kv_heads, max_len, shape.head_dim)
        self.keys = [torch.zeros(full, dtype=dtype) for _ in range(shape.layers)]
        self.values = [torch.zeros(full, dtype=dtype) for _ in range(shape.layers)]
        self.lengths = [0] * slots
        self.max_len = max_len

    def past(self, first: int, rows: int, upto: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views [rows, kvh, upto, hd] per layer of slot rows first..first+rows-1, padded to `upto`
        (None: the whole slot, a contiguous view — what a static-cache graph binds)."""
        end = first + rows
        if upto is None:
            return [(k[first:end], v[first:end]) for k, v in zip(self.keys, self.values, strict=True)]
        return [(k[first:end, :, :upto], v[first:end, :, :upto])
                for k, v in zip(self.keys, self.values, strict=True)]

    def write(
        self,
        present: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [rows, kvh, S, hd]
        *,
        source_offset: int,  # column of present where each row's new entries start
        counts: list[int],  # new entries to commit per row of present
        first_row: int = 0,  # slot row of present's row 0
    ) -> None:
        """Commit `counts[r]` entries of present row r at slot row first_row + r, from its current
        length on; advance the length."""
        rows = [r for r, n in enumerate(counts) for _ in range(n)]
        if not rows:
            return
        src = [source_offset + i for n in counts for i in range(n)]
        dst = [self.lengths[first_row + r] + i for r, n in enumerate(counts) for i in range(n)]
        if max(dst) >= self.max_len:
            raise CapacityError(f"KV slot overflow: position {max(dst)} >= slot length {self.max_len}")
        row_idx, src_idx, dst_idx = (torch.tensor(x) for x in (rows, src, dst))
        slot_idx = row_idx + first_row
        for (k, v), buf_k, buf_v in zip(present, self.keys, self.values, strict=True):
            buf_k[slot_idx, :, dst_idx] = torch.as_tensor(k)[row_idx, :, src_idx]
            buf_v[slot_idx, :, dst_idx] = torch.as_tensor(v)[row_idx, :, src_idx]
        for r, n in enumerate(counts):
            self.lengths[first_row + r] += n

    def move(self, source: int, dest: int) -> None:
        """Copy row `source`'s committed prefix into row `dest` (compaction on departure)."""
        n = self.lengths[source]
        for buf in (*self.keys, *self.values):
            buf[dest, :, :n] = buf[source, :, :n]
        self.lengths[dest] = n
        self.lengths[source] = 0

    def clear(self, row: int) -> None:
        self.lengths[row] = 0


@dataclass(frozen=True)
class Capacity:
    max_requests: int  # concurrent requests (slots)
    max_tokens: int  # sum over active requests of reserved positions
    max_seq_len: int  # positions per slot (prompt + new tokens + one block of lookahead)


class Admission:
    """Reservation bookkeeping: which requests are active, and whether a new one fits now."""

    def __init__(self, capacity: Capacity) -> None:
        self.capacity = capacity
        self.reserved: dict[int, int] = {}

    def check_servable(self, need: int) -> None:
        c = self.capacity
        if need > c.max_seq_len:
            raise CapacityError(f"request needs {need} positions but a slot holds {c.max_seq_len}; "
                                "shorten the prompt or max_new_tokens, or raise max_seq_len")
        if need > c.max_tokens:
            raise CapacityError(f"request needs {need} positions but max_tokens is {c.max_tokens}")

    def fits(self, need: int) -> bool:
        c = self.capacity
        return len(self.reserved) < c.max_requests and sum(self.reserved.values()) + need <= c.max_tokens

    def admit(self, request_id: int, need: int) -> None:
        self.reserved[request_id] = need

    def release(self, request_id: int) -> None:
        self.reserved.pop(request_id)
