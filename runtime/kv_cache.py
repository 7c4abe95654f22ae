"""KV cache manager: preallocated per-request slots, rollback, admission control.

Each cache is one buffer per layer and kind, `[slots, kv_heads, max_len, head_dim]`, allocated
once. Active requests occupy rows 0..R-1 (when one leaves, the last row moves into its place),
so the batch's past is the contiguous prefix `buffer[:R]`, a view, never a gather. A slot's
length is its committed prefix; rolling back rejected tokens is just not advancing it (the
rejected rows are overwritten next step). The buffers are numpy arrays on the host, or torch tensors
on a device (`device=`, what a GPU backend asks for: keys and values then never cross the bus; the
lengths stay host integers, which the scheduler reads every step). What fits (slots, positions, admission
control) is `capacity.py`, which the serving front end reads without torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .capacity import CacheShape, CapacityError

Array = np.ndarray | torch.Tensor


class SlotCache:
    """Per-layer key/value buffers [slots, kvh, max_len, hd] (allocated once: numpy, or torch tensors
    on `device`) plus each row's committed length. `kv` lists them in the export contract's order
    (key 0, value 0, ...)."""

    def __init__(self, shape: CacheShape, slots: int, max_len: int, dtype: np.dtype | str = np.float32,
                 device: torch.device | str | None = None):
        full = [(slots, shape.layer(i)[0], max_len, shape.layer(i)[1]) for i in range(shape.layers)]
        self.dtype = np.dtype(dtype)
        self.device = None if device is None else torch.device(device)
        if self.device is None:
            self.keys: list[Array] = [np.zeros(dims, dtype=self.dtype) for dims in full]
            self.values: list[Array] = [np.zeros(dims, dtype=self.dtype) for dims in full]
        else:
            as_dtype = torch.from_numpy(np.zeros(0, self.dtype)).dtype
            self.keys = [torch.zeros(dims, dtype=as_dtype, device=self.device) for dims in full]
            self.values = [torch.zeros(dims, dtype=as_dtype, device=self.device) for dims in full]
        self.kv = [buf for pair in zip(self.keys, self.values, strict=True) for buf in pair]
        self.lengths = np.zeros(slots, dtype=np.int64)
        self.max_len = max_len

    def index(self, positions: np.ndarray) -> Array:
        """Integer positions as an index into the buffers (a device tensor where they live on one)."""
        return self.indices(positions)[0]

    def indices(self, *positions: np.ndarray) -> tuple[Array, ...]:
        """Equal-shaped integer positions as indices into the buffers; to a device in one copy."""
        if self.device is None:
            return positions
        return tuple(torch.from_numpy(np.stack(positions)).to(self.device).unbind(0))

    def copy_row(self, row: int) -> list[np.ndarray]:
        """Host copies of row `row`'s committed prefix of every buffer, [kvh, length, hd] each."""
        n = int(self.lengths[row])
        return [buf[row, :, :n].to("cpu", copy=True).numpy() if isinstance(buf, torch.Tensor)
                else buf[row, :, :n].copy() for buf in self.kv]

    def load_row(self, row: int, prefixes: Sequence[np.ndarray]) -> None:
        """Row `row` holds `prefixes` (what `copy_row` gave) as its committed prefix."""
        for buf, prefix in zip(self.kv, prefixes, strict=True):
            buf[row, :, : prefix.shape[1]] = self.local(prefix)
        self.lengths[row] = prefixes[0].shape[1] if prefixes else 0

    def local(self, value: Array) -> Array:
        """`value` (a graph's output) where the buffers live: a host array, or a tensor on their device."""
        if self.device is None:
            return np.asarray(value)
        return (value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))).to(self.device)

    def past(self, first: int, rows: int, upto: int | None = None) -> list[tuple[Array, Array]]:
        """Views [rows, kvh, upto, hd] per layer of slot rows first..first+rows-1, padded to `upto`
        (None: the whole slot, a contiguous view — what static-cache and fused graphs bind)."""
        end = first + rows
        if upto is None:
            return [(k[first:end], v[first:end]) for k, v in zip(self.keys, self.values, strict=True)]
        return [(k[first:end, :, :upto], v[first:end, :, :upto])
                for k, v in zip(self.keys, self.values, strict=True)]

    def write(
        self,
        present: Sequence[tuple[Array, Array]],  # per layer [rows, kvh, S, hd]
        *,
        source_offset: int,  # column of present where each row's new entries start
        counts: Sequence[int] | np.ndarray,  # new entries to commit per row of present
        first_row: int = 0,  # slot row of present's row 0
    ) -> None:
        """Commit `counts[r]` entries of present row r at slot row first_row + r, from its current
        length on; advance the length. One gather and one scatter per buffer, whatever the rows."""
        counts = np.asarray(counts, dtype=np.int64)
        rows = np.repeat(np.arange(len(counts)), counts)
        if not rows.size:
            return
        within = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)  # 0.. per row
        slots = rows + first_row
        dst = self.lengths[slots] + within
        if dst.max() >= self.max_len:
            raise CapacityError(f"KV slot overflow: position {int(dst.max())} >= slot length {self.max_len}")
        src, rows, slots, dst = self.indices(source_offset + within, rows, slots, dst)
        for (k, v), buf_k, buf_v in zip(present, self.keys, self.values, strict=True):
            buf_k[slots, :, dst] = self.local(k)[rows, :, src]
            buf_v[slots, :, dst] = self.local(v)[rows, :, src]
        self.advance(counts, first_row)

    def advance(self, counts: Sequence[int] | np.ndarray, first_row: int = 0) -> None:
        """Count `counts[r]` more committed entries in slot row first_row + r (a graph that writes
        its keys and values in place has already put them there)."""
        self.lengths[first_row : first_row + len(counts)] += counts

    def move(self, source: int, dest: int) -> None:
        """Copy row `source`'s committed prefix into row `dest` (compaction on departure)."""
        n = int(self.lengths[source])
        for buf in self.kv:
            buf[dest, :, :n] = buf[source, :, :n]
        self.lengths[dest] = n
        self.lengths[source] = 0

    def clear(self, row: int) -> None:
        self.lengths[row] = 0
